"""Fair sharing over a synthetic day: the pure placement (`server/placement.py`) driven by a
discrete-event simulation, against plain priority-FIFO on the same trace.

    python bench/bench_fair_share.py [--hours 24 --seed 7 --grace-s 30 --min-runtime-s 60]

A cluster of 32 agents x 8 cpu slots; teams a, b, c with weights 1:1:2 and guarantees in the same
proportion (48/48/96 of 256 slots, the rest lent by fair share); skewed, bursty submissions
(a steady trickle from a, bursts from b, rare large bursts from c), gangs of 1-2 nodes x 1-8 slots,
lognormal run times (median 20 min). A scheduling pass runs at every event (a submit, an end, a
preempted job's exit), as the real scheduler runs one after each of them, and at least every
`--pass-s`. A preempted job stops `--stop-s` after its SIGTERM (default: the whole grace, the worst
case), then queues again with its remaining work: it checkpointed on its way out.

Prints one line of JSON. `ok` requires, over the time all three teams have work waiting, each
team's share of the busy slots within ±5 percentage points of its weighted fair share (25/25/50 %),
and every job its team could run within its guarantee started within stop time + min runtime + one
pass of its submit.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

try:
    from server.placement import AgentSlots, PendingJob, RunningJob, Sharing, TeamQuota, place
except ModuleNotFoundError:  # run as a script from a checkout where the project is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from server.placement import AgentSlots, PendingJob, RunningJob, Sharing, TeamQuota, place

AGENTS, SLOTS = 32, 8
WEIGHTS = {"a": 1.0, "b": 1.0, "c": 2.0}
GUARANTEES = {"a": 48, "b": 48, "c": 96}
TOLERANCE_PP = 5.0
WINDOW_S = 600.0


@dataclass
class Job:
    job_id: int
    team: str
    submit: float
    nodes: int
    per_node: int
    work_s: float  # run time left
    priority: int
    started: float | None = None  # first start
    attempt_start: float = 0.0
    slots: dict[int, list[int]] = field(default_factory=dict)  # agent -> slot indices held
    leaving_until: float | None = None
    stop_requested_at: float = 0.0
    attempt: int = 0
    preempted_by: int | None = None
    guaranteed_at_submit: bool = False

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


def trace(hours: float, seed: int) -> list[Job]:
    """Skewed, bursty submissions: a trickles, b bursts every ~2 h, c rarely but big."""
    rng = random.Random(seed)
    end = hours * 3600
    jobs: list[Job] = []

    def job(team: str, at: float) -> Job:
        return Job(
            job_id=0,
            team=team,
            submit=at,
            nodes=rng.choice((1, 1, 1, 2)),
            per_node=rng.randint(1, SLOTS),
            work_s=min(4 * 3600, max(120, rng.lognormvariate(math.log(1200), 1.0))),
            priority=rng.choice((0, 50, 50, 100)),
        )

    at = 0.0
    while (at := at + rng.expovariate(1 / 150)) < end:
        jobs.append(job("a", at))
    at = rng.uniform(0, 1800)
    while at < end:
        jobs.extend(job("b", at + rng.uniform(0, 300)) for _ in range(rng.randint(30, 60)))
        at += rng.uniform(1.5, 2.5) * 3600
    at = rng.uniform(3600, 3 * 3600)
    while at < end:
        jobs.extend(job("c", at + rng.uniform(0, 600)) for _ in range(rng.randint(60, 110)))
        at += rng.uniform(4, 6) * 3600
    jobs.sort(key=lambda j: j.submit)
    for number, j in enumerate(jobs, start=1):
        j.job_id = number
    return jobs


@dataclass
class Outcome:
    contended_s: float = 0.0
    slot_time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WEIGHTS, 0.0))
    windows: dict[int, dict[str, float]] = field(default_factory=dict)  # window -> team -> slot-s
    busy_slot_s: float = 0.0
    preemptions: int = 0
    stopping_slot_s: float = 0.0
    # job id -> from its submit until its team got that many slots more (see `owed` in simulate)
    guaranteed_waits: dict[int, float] = field(default_factory=dict)
    waits: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in WEIGHTS})
    passes: int = 0
    pass_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Policy:
    fair: bool  # False: plain priority-FIFO, no teams, no preemption
    grace_s: float
    stop_s: float
    min_runtime_s: float
    pass_s: float
    half_life_s: float
    history_weight: float


def simulate(jobs: list[Job], hours: float, policy: Policy) -> Outcome:
    jobs = [Job(**{k: v for k, v in vars(j).items() if k != "slots"}) for j in jobs]
    horizon = hours * 3600
    free = {agent: list(range(SLOTS)) for agent in range(AGENTS)}
    queued: dict[int, Job] = {}
    running: dict[int, Job] = {}
    usage = dict.fromkeys(WEIGHTS, 0.0)  # decayed, in slots
    quotas = {t: TeamQuota(weight=WEIGHTS[t], guarantee={"cpu": GUARANTEES[t]}) for t in WEIGHTS}
    out = Outcome()
    events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, job id, attempt)
    order = 0

    def push(at: float, kind: str, job: Job) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, job.job_id, job.attempt))

    by_id = {j.job_id: j for j in jobs}
    for j in jobs:
        push(j.submit, "submit", j)
    # What a team below its guarantee is owed: each job it submits within its guarantee adds its
    # size, and every slot the team is then given pays the oldest debt first. Priority orders a
    # team's own jobs, so the guarantee is owed to the team, not to a particular job of it.
    owed: dict[str, list[list[float]]] = {team: [] for team in WEIGHTS}  # [slots left, submit, job id]
    t = 0.0
    next_tick = 0.0
    fair, grace_s, stop_s, pass_s, half_life_s = (
        policy.fair,
        policy.grace_s,
        policy.stop_s,
        policy.pass_s,
        policy.half_life_s,
    )
    while events or t < horizon:
        at = min(events[0][0] if events else horizon, next_tick, horizon)
        if at >= horizon and not (events and events[0][0] < horizon):
            break
        # account the interval [t, at) with the state as it was
        dt = at - t
        if dt > 0:
            held = dict.fromkeys(WEIGHTS, 0)
            for j in running.values():
                held[j.team] += j.size
                if j.leaving_until is not None:
                    out.stopping_slot_s += j.size * dt
            out.busy_slot_s += sum(held.values()) * dt
            waiting_teams = {j.team for j in queued.values()}
            if waiting_teams == set(WEIGHTS) and any(held.values()):
                out.contended_s += dt
                window = out.windows.setdefault(int(t // WINDOW_S), dict.fromkeys(WEIGHTS, 0.0))
                for team in WEIGHTS:
                    out.slot_time[team] += held[team] * dt
                    window[team] += held[team] * dt
            decay = 2.0 ** (-dt / half_life_s)
            for team in WEIGHTS:
                usage[team] = usage[team] * decay + held[team] * (1 - decay)
        t = at
        # apply every event at this instant, then one pass
        while events and events[0][0] <= t:
            _, _, kind, job_id, attempt = heapq.heappop(events)
            j = by_id[job_id]
            current = job_id in running and attempt == j.attempt
            if kind == "submit":
                demand = sum(x.size for x in [*running.values(), *queued.values()] if x.team == j.team)
                j.guaranteed_at_submit = demand + j.size <= GUARANTEES[j.team]
                if j.guaranteed_at_submit:
                    owed[j.team].append([float(j.size), j.submit, float(j.job_id)])
                queued[job_id] = j
            elif kind == "end" and current:  # done (even while stopping: it finished first)
                release(j, free)
                del running[job_id]
            elif kind == "stopped" and current:  # it checkpointed at its SIGTERM: that work is kept
                j.work_s -= j.stop_requested_at - j.attempt_start
                release(j, free)
                del running[job_id]
                j.leaving_until = None
                queued[job_id] = j
        if t >= next_tick:
            next_tick = t + pass_s
        if not queued:
            continue
        pending = [
            PendingJob(
                j.job_id,
                j.priority,
                j.job_id,
                j.nodes,
                j.per_node,
                "cpu",
                team=j.team if fair else "",
                user="u",
                preempted_by=j.preempted_by,
            )
            for j in queued.values()
        ]
        agents = [AgentSlots(a, f"n{a:03d}", "cpu", SLOTS, tuple(sorted(slots))) for a, slots in free.items()]
        sharing = None
        if fair:
            runs = tuple(
                RunningJob(
                    j.job_id,
                    j.team,
                    "u",
                    "cpu",
                    j.priority,
                    tuple((a, len(s)) for a, s in j.slots.items()),
                    t - j.attempt_start,
                    j.leaving_until is not None,
                )
                for j in running.values()
            )
            sharing = Sharing(
                teams=quotas,
                usage={(team, "cpu"): usage[team] for team in WEIGHTS},
                running=runs,
                min_runtime_s=policy.min_runtime_s,
                history_weight=policy.history_weight,
            )
        started = time.perf_counter()
        result = place(pending, agents, sharing)
        out.pass_s.append(time.perf_counter() - started)
        out.passes += 1
        for placement in result.placements:
            j = queued.pop(placement.job_id)
            for node in placement.nodes:
                j.slots[node.agent_id] = list(node.slot_indices)
                for index in node.slot_indices:
                    free[node.agent_id].remove(index)
            if j.started is None:
                j.started = t
                out.waits[j.team].append(t - j.submit)
            paying = float(j.size)
            debts = owed[j.team]
            while paying > 0 and debts:
                paid = min(paying, debts[0][0])
                debts[0][0] -= paid
                paying -= paid
                if debts[0][0] <= 0:
                    _, submitted, owed_job = debts.pop(0)
                    out.guaranteed_waits[int(owed_job)] = t - submitted
            j.attempt_start = t
            j.attempt += 1
            running[j.job_id] = j
            push(t + j.work_s, "end", j)
        for preemption in result.preemptions:
            victim = running[preemption.job_id]
            if victim.leaving_until is not None:
                continue
            out.preemptions += 1
            victim.leaving_until = t + min(stop_s, grace_s)
            victim.stop_requested_at = t
            victim.preempted_by = preemption.for_job_id
            push(victim.leaving_until, "stopped", victim)
    return out


def release(j: Job, free: dict[int, list[int]]) -> None:
    for agent, slots in j.slots.items():
        free[agent].extend(slots)
    j.slots = {}


def summary(out: Outcome, hours: float) -> dict[str, object]:
    total = sum(out.slot_time.values()) or 1.0
    weight_sum = sum(WEIGHTS.values())
    shares = {team: round(100 * out.slot_time[team] / total, 2) for team in WEIGHTS}
    fair = {team: round(100 * WEIGHTS[team] / weight_sum, 2) for team in WEIGHTS}
    within = 0
    counted = 0
    for window in out.windows.values():
        busy = sum(window.values())
        if busy <= 0:
            continue
        counted += 1
        within += all(abs(100 * window[t] / busy - fair[t]) <= TOLERANCE_PP for t in WEIGHTS)
    waits = sorted(out.guaranteed_waits.values())
    return {
        "contended_h": round(out.contended_s / 3600, 2),
        "share_pct": shares,
        "fair_share_pct": fair,
        "max_share_error_pp": round(max(abs(shares[t] - fair[t]) for t in WEIGHTS), 2),
        "windows_within_5pp": f"{within}/{counted}",
        "guaranteed_jobs": len(waits),
        "guaranteed_wait_max_s": round(waits[-1], 1) if waits else None,
        "guaranteed_wait_p95_s": round(waits[int(0.95 * (len(waits) - 1))], 1) if waits else None,
        "median_wait_min": {t: round(statistics.median(w) / 60, 1) if w else None for t, w in out.waits.items()},
        "preemptions_per_hour": round(out.preemptions / hours, 2),
        "stopping_slot_hours": round(out.stopping_slot_s / 3600, 1),
        "utilisation": round(out.busy_slot_s / (AGENTS * SLOTS * hours * 3600), 3),
        "passes": out.passes,
        "pass_p99_ms": round(1000 * sorted(out.pass_s)[int(0.99 * (len(out.pass_s) - 1))], 2) if out.pass_s else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--seeds", default="7,8,9", help="one synthetic day per seed")
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--stop-s", type=float, default=None, help="a victim's time to stop (default: the grace)")
    parser.add_argument("--min-runtime-s", type=float, default=60.0)
    parser.add_argument("--pass-s", type=float, default=3.0)
    parser.add_argument("--half-life-s", type=float, default=3600.0)
    parser.add_argument("--history-weight", type=float, default=0.25)
    parser.add_argument("--compare", default="0,1,4", help="other history weights to report (no goal)")
    args = parser.parse_args()
    stop_s = args.grace_s if args.stop_s is None else args.stop_s
    policy = Policy(True, args.grace_s, stop_s, args.min_runtime_s, args.pass_s, args.half_life_s, args.history_weight)
    bound = stop_s + args.min_runtime_s + args.pass_s
    started = time.perf_counter()
    runs: dict[str, object] = {}
    ok = True
    compared: dict[str, dict[str, object]] = {}
    for seed in (int(text) for text in args.seeds.split(",")):
        jobs = trace(args.hours, seed)
        fair = summary(simulate(jobs, args.hours, policy), args.hours)
        fifo = summary(simulate(jobs, args.hours, replace(policy, fair=False)), args.hours)
        ok = ok and float(str(fair["max_share_error_pp"])) <= TOLERANCE_PP
        waited = fair["guaranteed_wait_max_s"]
        ok = ok and (waited is None or float(str(waited)) <= bound)
        runs[f"seed {seed}"] = {"jobs": len(jobs), "fair_share": fair, "priority_fifo": fifo}
        for weight in (float(text) for text in args.compare.split(",") if text):
            other = summary(simulate(jobs, args.hours, replace(policy, history_weight=weight)), args.hours)
            compared.setdefault(f"history weight {weight:g}", {})[f"seed {seed}"] = {
                key: other[key] for key in ("max_share_error_pp", "preemptions_per_hour", "guaranteed_wait_max_s")
            }
    print(
        json.dumps(
            {
                "bench": "fair_share",
                "hours": args.hours,
                "grace_s": args.grace_s,
                "stop_s": stop_s,
                "min_runtime_s": args.min_runtime_s,
                "history_weight": args.history_weight,
                "guaranteed_wait_bound_s": bound,
                "runs": runs,
                "compared": compared,
                "wall_s": round(time.perf_counter() - started, 1),
                "ok": ok,
            }
        )
    )


if __name__ == "__main__":
    main()
