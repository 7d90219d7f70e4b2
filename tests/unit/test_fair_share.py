"""Fair sharing in the pure placement: property tests of limits, preemption and convergence, then
examples of each rule. The running jobs are built from the agents' busy slots, so what the pass
is told is held is exactly what is not free."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from server.placement import AgentSlots, PendingJob, PlacementResult, RunningJob, Sharing, TeamQuota, place

PROPERTY = settings(max_examples=150, deadline=None)
TEAMS = ("x", "y", "z")


# --- strategies ----------------------------------------------------------------------------------


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[PendingJob], list[AgentSlots], Sharing]:
    """Agents with some slots busy; each busy run of slots is a running job of some team."""
    agents: list[AgentSlots] = []
    running: list[RunningJob] = []
    for agent_id in range(1, draw(st.integers(1, 5)) + 1):
        capacity = draw(st.integers(1, 8))
        busy = draw(st.integers(0, capacity) | st.integers(max(0, capacity - 2), capacity))  # mostly full
        agents.append(AgentSlots(agent_id, f"n{agent_id}", "cpu", capacity, tuple(range(busy, capacity))))
        while busy:
            take = draw(st.integers(1, busy))
            busy -= take
            running.append(
                RunningJob(
                    job_id=1000 + len(running),
                    team=draw(st.sampled_from(TEAMS)),
                    user=draw(st.sampled_from(("u1", "u2"))),
                    slot_type="cpu",
                    priority=draw(st.sampled_from((0, 50, 100))),
                    slots=((agent_id, take),),
                    runtime_s=draw(st.sampled_from((0.0, 30.0, 600.0, 600.0))),
                    leaving=draw(st.booleans()) and draw(st.booleans()),
                )
            )
    quotas = {}
    for team in TEAMS:
        limit = draw(st.one_of(st.none(), st.integers(0, 16)))
        user_limit = draw(st.one_of(st.none(), st.integers(0, 16)))
        quotas[team] = TeamQuota(
            weight=draw(st.sampled_from((1.0, 2.0, 3.0))),
            guarantee={"cpu": draw(st.integers(0, 12))},
            limit={} if limit is None else {"cpu": limit},
            user_limit={} if user_limit is None else {"cpu": user_limit},
            held=draw(st.booleans()) and draw(st.booleans()),
        )
    jobs = draw(
        st.lists(
            st.builds(
                PendingJob,
                job_id=st.integers(1, 500),
                priority=st.sampled_from((0, 50, 100)),
                seq=st.integers(0, 20),
                nodes=st.integers(1, 2) | st.integers(1, 3),
                slots_per_node=st.integers(1, 3) | st.integers(1, 8),
                slot_type=st.just("cpu"),
                team=st.sampled_from(TEAMS),
                user=st.sampled_from(("u1", "u2")),
                held=st.sampled_from((False, False, False, False, True)),
                preempted_by=st.one_of(st.none(), st.sampled_from(range(1000, 1010))),
            ),
            unique_by=lambda job: job.job_id,
            max_size=12,
        )
    )
    usage = {(team, "cpu"): draw(st.floats(0, 20)) for team in TEAMS}
    sharing = Sharing(
        teams=quotas,
        usage=usage,
        running=running,
        min_runtime_s=draw(st.sampled_from((0.0, 60.0))),
        history_weight=draw(st.sampled_from((0.0, 0.25, 1.0))),
    )
    return jobs, agents, sharing


@st.composite
def owed_worlds(draw: st.DrawFn) -> tuple[list[PendingJob], list[AgentSlots], Sharing]:
    """Worlds where preemption is likely: team z holds nothing and is owed a large guarantee, while
    x and y borrow everything."""
    jobs, agents, sharing = draw(worlds())
    running = [replace(run, team="x") if run.team == "z" else run for run in sharing.running]
    teams = {
        "x": replace(sharing.teams["x"], guarantee={}, limit={}, user_limit={}),
        "y": replace(sharing.teams["y"], guarantee={}, limit={}, user_limit={}),
        "z": TeamQuota(guarantee={"cpu": draw(st.integers(4, 24))}),
    }
    return jobs, agents, replace(sharing, teams=teams, running=running)


any_world = worlds() | owed_worlds()
mostly_owed = owed_worlds() | owed_worlds() | worlds()


def size(job: PendingJob | RunningJob) -> int:
    if isinstance(job, RunningJob):
        return sum(count for _, count in job.slots)
    return job.nodes * job.slots_per_node


def holdings(sharing: Sharing, *, staying: bool = False) -> Counter[str]:
    held: Counter[str] = Counter()
    for run in sharing.running:
        if not (staying and run.leaving):
            held[run.team] += size(run)
    return held


def fits(job: PendingJob, free: dict[int, int]) -> bool:
    return sum(1 for count in free.values() if count >= job.slots_per_node) >= job.nodes


def respects_limits(sharing: Sharing) -> bool:
    held = holdings(sharing)
    by_user: Counter[tuple[str, str]] = Counter()
    for run in sharing.running:
        by_user[(run.team, run.user)] += size(run)
    for team, quota in sharing.teams.items():
        if "cpu" in quota.limit and held[team] > quota.limit["cpu"]:
            return False
        if "cpu" in quota.user_limit and any(
            count > quota.user_limit["cpu"] for (owner, _), count in by_user.items() if owner == team
        ):
            return False
    return True


# --- properties ----------------------------------------------------------------------------------


@PROPERTY
@given(world=any_world)
def test_hard_constraints_hold_with_sharing(world: tuple[list[PendingJob], list[AgentSlots], Sharing]) -> None:
    jobs, agents, sharing = world
    result = place(jobs, agents, sharing)
    by_id = {job.job_id: job for job in jobs}
    placed = [p.job_id for p in result.placements]
    assert set(placed).isdisjoint(result.waiting) and set(placed) | set(result.waiting) == set(by_id)
    free = {a.agent_id: set(a.free) for a in agents}
    for placement in result.placements:
        job = by_id[placement.job_id]
        assert len({n.agent_id for n in placement.nodes}) == job.nodes
        for node in placement.nodes:
            assert len(node.slot_indices) == job.slots_per_node
            assert set(node.slot_indices) <= free[node.agent_id], "a slot given twice, or a busy one"
            free[node.agent_id] -= set(node.slot_indices)
        assert not job.held
    out_of_line = {
        job_id
        for job_id, reason in result.waiting.items()
        if reason.startswith(("held by an admin", "can never run", "asks for")) or "queue is held" in reason
    }
    assert set(result.order) == set(by_id) - out_of_line
    for reason in result.waiting.values():
        assert reason and "\n" not in reason


@PROPERTY
@given(world=worlds())
def test_a_team_never_holds_more_than_its_limit_nor_a_user_more_than_theirs(
    world: tuple[list[PendingJob], list[AgentSlots], Sharing],
) -> None:
    jobs, agents, sharing = world
    if not respects_limits(sharing):
        sharing = replace(sharing, teams={t: replace(q, limit={}, user_limit={}) for t, q in sharing.teams.items()})
    result = place(jobs, agents, sharing)
    by_id = {job.job_id: job for job in jobs}
    held = holdings(sharing)
    by_user: Counter[tuple[str, str]] = Counter(
        (run.team, run.user) for run in sharing.running for _ in range(size(run))
    )
    for placement in result.placements:
        job = by_id[placement.job_id]
        held[job.team] += size(job)
        by_user[(job.team, job.user)] += size(job)
    for team, quota in sharing.teams.items():
        if "cpu" in quota.limit:
            assert held[team] <= quota.limit["cpu"], team
        if "cpu" in quota.user_limit:
            for (owner, user), count in by_user.items():
                assert owner != team or count <= quota.user_limit["cpu"], (team, user)


@PROPERTY
@given(world=mostly_owed)
def test_preemption_takes_borrowed_slots_only_and_no_more_than_the_fit_needs(
    world: tuple[list[PendingJob], list[AgentSlots], Sharing],
) -> None:
    jobs, agents, sharing = world
    result = place(jobs, agents, sharing)
    by_id = {job.job_id: job for job in jobs}
    running = {run.job_id: run for run in sharing.running}
    staying = holdings(sharing, staying=True)
    held = holdings(sharing)
    by_preemptor: dict[int, list[RunningJob]] = {}
    position = {job_id: number for number, job_id in enumerate(result.order)}
    for preemption in result.preemptions:
        victim, job = running[preemption.job_id], by_id[preemption.for_job_id]
        by_preemptor.setdefault(job.job_id, []).append(victim)
        quota, victim_quota = sharing.teams[job.team], sharing.teams[victim.team]
        assert victim.slot_type == job.slot_type and victim.team != job.team
        assert not victim.leaving and victim.runtime_s >= sharing.min_runtime_s
        assert victim.job_id != job.preempted_by, "a job preempted the job that preempted it"
        # what the victim's team holds when the preemptor's turn comes: its jobs placed before it count
        placed_before = sum(
            size(by_id[p.job_id])
            for p in result.placements
            if by_id[p.job_id].team == victim.team and position[p.job_id] < position[job.job_id]
        )
        held_then = staying[victim.team] + placed_before
        assert held_then > victim_quota.guarantee.get("cpu", 0), "the victim's team was not borrowing"
        assert held[job.team] + size(job) <= quota.guarantee.get("cpu", 0), "the preemptor was past its guarantee"
        assert preemption.job_id not in [p.job_id for p in result.placements]
        assert job.job_id in result.waiting and "preempted" in result.waiting[job.job_id]
    victims = [p.job_id for p in result.preemptions]
    assert len(victims) == len(set(victims))
    for job_id, chosen in by_preemptor.items():
        job = by_id[job_id]
        free = {a.agent_id: len(a.free) for a in agents}
        for run in sharing.running:
            if run.leaving:
                for agent_id, count in run.slots:
                    free[agent_id] += count
        with_all = dict(free)
        for run in chosen:
            for agent_id, count in run.slots:
                with_all[agent_id] += count
        assert fits(job, with_all), "its victims do not make room for it"
        if any(run.leaving for run in sharing.running):
            continue  # which stopping jobs a preemptor counts on depends on the jobs before it
        earlier = result.order[: result.order.index(job_id)]
        placed = {p.job_id: p for p in result.placements}
        if any(other not in placed for other in earlier):
            continue  # an earlier job that waits may hold slots (a reservation, its own preemption)
        for other in earlier:  # what the jobs placed before it took was not there for it
            for node in placed[other].nodes:
                free[node.agent_id] -= len(node.slot_indices)
                with_all[node.agent_id] -= len(node.slot_indices)
        for spared in chosen:  # every victim is needed
            without = dict(with_all)
            for agent_id, count in spared.slots:
                without[agent_id] -= count
            assert not fits(job, without) or (len(chosen) == 1 and fits(job, free)), "a victim was not needed"


def carry_out(
    result: PlacementResult, jobs: list[PendingJob], agents: list[AgentSlots], sharing: Sharing
) -> tuple[list[PendingJob], list[AgentSlots], Sharing]:
    """The pass's decisions done and the victims gone: placed jobs run, victims queue again with
    `preempted_by`, and every leaving job's slots are free."""
    by_id = {job.job_id: job for job in jobs}
    free = {a.agent_id: list(a.free) for a in agents}
    victims = {p.job_id: p.for_job_id for p in result.preemptions}
    running = []
    for run in sharing.running:
        if run.leaving or run.job_id in victims:
            for agent_id, count in run.slots:
                free[agent_id] = sorted(free[agent_id] + [-1] * count)  # placeholders, renumbered below
        else:
            running.append(run)
    for placement in result.placements:
        job = by_id[placement.job_id]
        for node in placement.nodes:
            free[node.agent_id] = [i for i in free[node.agent_id] if i not in node.slot_indices]
        slots = tuple((node.agent_id, len(node.slot_indices)) for node in placement.nodes)
        running.append(RunningJob(job.job_id, job.team, job.user, job.slot_type, job.priority, slots, 1e6))
    queue = [job for job in jobs if job.job_id not in {p.job_id for p in result.placements}]
    for run in sharing.running:
        if run.job_id in victims:
            per_node = run.slots[0][1] if len(run.slots) == 1 else 1
            queue.append(
                PendingJob(
                    run.job_id, run.priority, 99, 1, per_node, "cpu", run.team, run.user, False, victims[run.job_id]
                )
            )
    renumbered = []
    for agent in agents:
        count = len(free[agent.agent_id])
        renumbered.append(replace(agent, free=tuple(range(agent.capacity - count, agent.capacity))))
    return queue, renumbered, replace(sharing, running=running)


@PROPERTY
@given(world=mostly_owed)
def test_a_preemptor_starts_at_the_next_pass_and_is_never_preempted_back(
    world: tuple[list[PendingJob], list[AgentSlots], Sharing],
) -> None:
    jobs, agents, sharing = world
    result = place(jobs, agents, sharing)
    if not result.preemptions:
        return
    preemptor = result.preemptions[0].for_job_id
    queue, after, then = carry_out(result, jobs, agents, sharing)
    # only it and its victims in line: no other job may take the room it made
    queue = [job for job in queue if job.job_id == preemptor or job.preempted_by == preemptor]
    second = place(queue, after, then)
    assert preemptor in [p.job_id for p in second.placements], second.waiting.get(preemptor)
    # the victims queue again; the preemptor now runs, and none of them may take its slots back
    queue, after, then = carry_out(second, queue, after, then)
    third = place(queue, after, then)
    assert preemptor not in [p.job_id for p in third.preemptions]


@PROPERTY
@given(world=worlds(), shuffle=st.randoms(use_true_random=False))
def test_same_input_in_any_order_gives_the_same_output(
    world: tuple[list[PendingJob], list[AgentSlots], Sharing], shuffle: random.Random
) -> None:
    jobs, agents, sharing = world
    shuffled_jobs, shuffled_agents, shuffled_running = list(jobs), list(agents), list(sharing.running)
    for items in (shuffled_jobs, shuffled_agents, shuffled_running):
        shuffle.shuffle(items)
    first = place(jobs, agents, sharing)
    second = place(shuffled_jobs, shuffled_agents, replace(sharing, running=shuffled_running))
    assert first == second


@settings(max_examples=25, deadline=None)
@given(
    weights=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    seed=st.integers(0, 10_000),
)
def test_with_every_team_saturated_the_shares_converge_to_the_weights(weights: tuple[int, int, int], seed: int) -> None:
    """Long backlogs of one-slot jobs from three teams on 64 slots; between passes random running
    jobs end and decayed usage moves towards what each team holds. After a warm-up, each team's
    time-averaged share is within 5 points of its weight's share."""
    rng = random.Random(seed)
    agents_count, capacity = 8, 8
    quotas = {team: TeamQuota(weight=float(weight)) for team, weight in zip(TEAMS, weights, strict=True)}
    usage = dict.fromkeys(((team, "cpu") for team in TEAMS), 0.0)
    running: list[RunningJob] = []
    next_id = 1
    backlog = {team: 0 for team in TEAMS}
    share_sum = dict.fromkeys(TEAMS, 0.0)
    for step in range(300):
        while len(running) and rng.random() < 0.9:
            running.pop(rng.randrange(len(running)))  # a job ends
            if rng.random() < 0.5:
                break
        busy = Counter(agent_id for run in running for agent_id, _ in run.slots)
        agents = [AgentSlots(a, f"n{a}", "cpu", capacity, tuple(range(busy[a], capacity))) for a in range(agents_count)]
        queue = []
        for team in TEAMS:
            while backlog[team] < 20:
                backlog[team] += 1
            for _ in range(backlog[team]):
                queue.append(PendingJob(next_id, 50, next_id, 1, 1, "cpu", team=team, user="u"))
                next_id += 1
        sharing = Sharing(teams=quotas, usage=usage, running=running)
        result = place(queue, agents, sharing)
        by_id = {job.job_id: job for job in queue}
        for placement in result.placements:
            job = by_id[placement.job_id]
            node = placement.nodes[0]
            running.append(RunningJob(job.job_id, job.team, "u", "cpu", 50, ((node.agent_id, 1),), 0.0))
        held = Counter(run.team for run in running)
        for team in TEAMS:
            usage[(team, "cpu")] = 0.9 * usage[(team, "cpu")] + 0.1 * held[team]
        if step >= 50:
            total = sum(held.values())
            for team in TEAMS:
                share_sum[team] += held[team] / total
    total_weight = sum(weights)
    for team, weight in zip(TEAMS, weights, strict=True):
        average = share_sum[team] / 250
        assert abs(average - weight / total_weight) <= 0.05, (team, average, weight / total_weight)


# --- examples ------------------------------------------------------------------------------------


def one_slot_agents(count: int, busy: int = 0) -> list[AgentSlots]:
    return [AgentSlots(a, f"n{a}", "cpu", 1, () if a < busy else (0,)) for a in range(count)]


def job(job_id: int, team: str, slots: int = 1, **fields: object) -> PendingJob:
    return PendingJob(job_id, 50, job_id, 1, slots, "cpu", team=team, user="u", **fields)  # type: ignore[arg-type]


def test_a_team_that_holds_nothing_goes_before_a_busy_teams_backlog() -> None:
    """Team a runs on one of two slots with four jobs waiting; b submitted later and holds nothing."""
    running = [RunningJob(100, "a", "u", "cpu", 50, ((0, 1),), 60.0)]
    queue = [job(i, "a") for i in range(1, 5)] + [job(9, "b")]
    result = place(queue, one_slot_agents(2, busy=1), Sharing(running=running))
    assert [p.job_id for p in result.placements] == [9]
    assert result.order[0] == 9


def test_without_sharing_teams_are_ignored() -> None:
    queue = [job(i, "a") for i in range(1, 5)] + [job(9, "b")]
    assert [p.job_id for p in place(queue, one_slot_agents(2)).placements] == [1, 2]


def test_a_limit_keeps_a_job_waiting_on_free_slots_and_says_so() -> None:
    sharing = Sharing(teams={"a": TeamQuota(limit={"cpu": 1})})
    result = place([job(1, "a"), job(2, "a")], one_slot_agents(2), sharing)
    assert [p.job_id for p in result.placements] == [1]
    assert result.waiting[2].startswith("team a's limit is 1 cpu slot and it holds 1")


def test_a_user_limit_keeps_one_member_to_their_share() -> None:
    sharing = Sharing(teams={"a": TeamQuota(user_limit={"cpu": 1})})
    queue = [job(1, "a"), job(2, "a"), replace(job(3, "a"), user="v")]
    result = place(queue, one_slot_agents(3), sharing)
    assert [p.job_id for p in result.placements] == [1, 3]
    assert "may hold at most 1 cpu slot in team a" in result.waiting[2]


def test_held_jobs_and_held_teams_wait_and_name_the_release_command() -> None:
    sharing = Sharing(teams={"b": TeamQuota(held=True)})
    result = place([job(1, "a", held=True), job(2, "b"), job(3, "a")], one_slot_agents(3), sharing)
    assert [p.job_id for p in result.placements] == [3]
    assert "phalanx jobs release 1" in result.waiting[1]
    assert "phalanx teams release b" in result.waiting[2]
    assert result.order == [3]


def test_a_job_within_its_guarantee_preempts_the_youngest_borrower_it_needs() -> None:
    running = [
        RunningJob(100, "a", "u", "cpu", 50, ((0, 1),), 900.0),
        RunningJob(101, "a", "u", "cpu", 50, ((1, 1),), 120.0),  # younger: less work lost
        RunningJob(102, "b", "u", "cpu", 50, ((2, 1),), 30.0),  # b's own
    ]
    sharing = Sharing(teams={"b": TeamQuota(guarantee={"cpu": 2})}, running=running, min_runtime_s=60)
    result = place([job(1, "b")], one_slot_agents(3, busy=3), sharing)
    assert [(p.job_id, p.for_job_id) for p in result.preemptions] == [(101, 1)]
    assert "job 101 (borrowing those slots) is being preempted" in result.waiting[1]
    # too young to preempt: it waits and nothing is stopped
    young = replace(sharing, min_runtime_s=1000)
    assert place([job(1, "b")], one_slot_agents(3, busy=3), young).preemptions == []


def test_a_job_past_its_guarantee_preempts_nothing() -> None:
    running = [RunningJob(100, "a", "u", "cpu", 50, ((0, 1),), 900.0)]
    sharing = Sharing(teams={"b": TeamQuota(guarantee={"cpu": 1})}, running=running)
    assert place([job(1, "b", slots=1)], one_slot_agents(1, busy=1), sharing).preemptions != []
    assert place([job(1, "b", slots=2)], [AgentSlots(0, "n0", "cpu", 2, (1,))], sharing).preemptions == []


def test_a_job_waits_for_the_jobs_already_stopping_for_it_instead_of_preempting_more() -> None:
    running = [
        RunningJob(100, "a", "u", "cpu", 50, ((0, 1),), 900.0, leaving=True, stopping_for=1),
        RunningJob(101, "a", "u", "cpu", 50, ((1, 1),), 900.0),
    ]
    sharing = Sharing(teams={"b": TeamQuota(guarantee={"cpu": 1})}, running=running)
    result = place([job(1, "b")], one_slot_agents(2, busy=2), sharing)
    assert result.preemptions == [] and "waiting for job 100 to stop" in result.waiting[1]
    # slots stopping for another queued job are that job's: this one preempts its own victim
    other = replace(sharing, running=[replace(running[0], stopping_for=2), running[1]])
    result = place([job(1, "b"), job(2, "c")], one_slot_agents(2, busy=2), other)
    assert [p.job_id for p in result.preemptions] == [101]
