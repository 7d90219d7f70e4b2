"""Start estimates: a replay of the placement policy over the running jobs' known ends."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

import pytest

from server.forecast import estimate_starts
from server.placement import AgentSlots, PendingJob, RunningJob, Sharing, TeamQuota
from server.sharing import SlotInterval, decayed_slots, decayed_usage, slot_hours


def agent(agent_id: int, free: tuple[int, ...], capacity: int = 2) -> AgentSlots:
    return AgentSlots(agent_id, f"n{agent_id}", "cpu", capacity, free)


def queued(job_id: int, slots: int = 1, team: str = "") -> PendingJob:
    return PendingJob(job_id, 50, job_id, 1, slots, "cpu", team=team, user="u")


def running(job_id: int, agent_id: int, slots: int, team: str = "") -> RunningJob:
    return RunningJob(job_id, team, "u", "cpu", 50, ((agent_id, slots),), 100.0)


def test_jobs_start_when_the_running_jobs_they_wait_for_end() -> None:
    agents = [agent(1, ()), agent(2, ())]  # both full: job 10 holds n1, job 11 holds n2
    sharing = Sharing(running=(running(10, 1, 2), running(11, 2, 2)))
    queue = [queued(1, 2), queued(2, 2), queued(3, 1)]
    estimates = estimate_starts(queue, agents, sharing, {10: 60.0, 11: 300.0})
    assert estimates == {1: 60.0, 2: 300.0}  # job 3 waits for job 1, which never ends in the replay


def test_a_job_that_fits_now_starts_now_and_unknown_ends_give_no_estimate() -> None:
    agents = [agent(1, (0,)), agent(2, ())]
    sharing = Sharing(running=(running(10, 1, 1), running(11, 2, 2)))
    assert estimate_starts([queued(1), queued(2, 2)], agents, sharing, {}) == {1: 0.0}


def test_the_replay_keeps_team_limits_and_never_preempts() -> None:
    agents = [agent(1, ())]
    teams = {"a": TeamQuota(limit={"cpu": 1}), "b": TeamQuota(guarantee={"cpu": 2})}
    sharing = Sharing(teams=teams, running=(running(10, 1, 2, team="x"),), min_runtime_s=0)
    queue = [queued(1, 1, team="a"), queued(2, 1, team="a"), queued(3, 2, team="b")]
    estimates = estimate_starts(queue, agents, sharing, {10: 30.0})
    # b goes first (within its guarantee), and nothing is preempted before job 10 ends
    assert estimates == {3: 30.0}


def test_decayed_usage_is_in_slots_and_halves_every_half_life() -> None:
    now = datetime(2026, 12, 5, 12)
    hour = timedelta(hours=1)
    # held for a very long time up to now: one slot's decayed usage tends to 1 slot
    assert decayed_slots(now - 100 * hour, now, now, 3600) == pytest.approx(1.0)
    # the same hour counts half as much one half-life later
    recent = decayed_slots(now - hour, now, now, 3600)
    older = decayed_slots(now - 2 * hour, now - hour, now, 3600)
    assert recent == pytest.approx(0.5) and older == pytest.approx(recent / 2)
    intervals = [
        SlotInterval("u", "a", "cpu", 4, 1, now - 100 * hour, None),
        SlotInterval("v", "a", "cpu", 2, 2, now - 100 * hour, now - 100 * hour + hour),
        SlotInterval("u", "b", "gpu", 1, 3, now - hour, now),
    ]
    usage = decayed_usage(intervals, now, 3600)
    assert usage[("a", "cpu")] == pytest.approx(4.0)
    assert usage[("b", "gpu")] == pytest.approx(0.5)
    assert math.isfinite(sum(usage.values()))


def test_slot_hours_count_only_the_part_inside_the_period() -> None:
    start = datetime(2026, 12, 5)
    interval = SlotInterval("u", "", "cpu", 3, 1, start, start + timedelta(hours=2))
    assert slot_hours(interval, start + timedelta(hours=1), start + timedelta(hours=10)) == pytest.approx(3.0)
    assert slot_hours(interval, start + timedelta(hours=5), start + timedelta(hours=10)) == 0.0
    still_held = SlotInterval("u", "", "cpu", 1, 1, start, None)
    assert slot_hours(still_held, start, start + timedelta(minutes=30)) == pytest.approx(0.5)
