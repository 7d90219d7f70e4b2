"""Gang placement as a pure function: pending jobs + free slots -> placements and reasons to wait.

Contract
--------
- ``place()`` and ``never_fits()`` do no I/O, keep no state between calls and never mutate their
  inputs; they are safe to call from any thread.
- Hard constraints filter: a gang of ``nodes`` nodes goes on ``nodes`` distinct agents that offer its
  ``slot_type``, each with at least ``slots_per_node`` free slots; it is placed whole or not at all;
  every node gets exactly ``slots_per_node`` slots, the lowest free indices; no slot is given twice.
- Jobs are considered by priority (higher first), then ``seq`` (earlier first), then ``job_id``.
- Soft score, best fit: the agents whose free count is smallest but sufficient win, so big holes stay
  for big gangs. Ties break on (free count, name, agent_id); node rank 0 is the first agent chosen.
- Backfill, EASY style without run-time estimates: the first job that could run on these agents but
  cannot run now (the head of the queue) reserves ``nodes`` agents whose capacity is large enough
  (most free now first, then name, agent_id) and holds up to ``slots_per_node`` of their free slots.
  Later jobs may only use slots outside that reservation. Only that one job reserves, whatever its
  slot type.
- Jobs that can never fit on the given agents, or that ask for fewer than one node or slot, wait
  with a reason that says so; they never reserve.

Sharing between teams (``place(..., sharing=Sharing(...))``; without it, teams are ignored)
--------------------------------------------------------------------------------------------
- Each (team, slot type) has its own queue, ordered by priority, then ``seq``, then ``job_id``:
  priority orders jobs within a team only. Held jobs and the jobs of a held team wait, unordered.
- Queues take turns by (tier, share): tier 0 is a job its team can start within its guarantee
  (what it holds plus the job fits in ``guarantee``), tier 1 the rest; ``share`` is what the team
  holds now plus ``history_weight`` times its decayed usage (both in slots of that type), divided
  by its weight. Each placement raises the placing team's share before the next pick, so with all
  teams waiting, slots go to the team furthest below its weighted share. Ties break on team name.
  Why both terms: ordering by decayed usage alone (Slurm) acts like an integral controller, so a
  team back from an idle spell takes more than its weight until its usage catches up (in
  `bench/bench_fair_share.py`: 5 to 6 points over, and 3 to 7 times the preemptions); current holdings alone
  (Kueue) forget that a team just had the cluster. A quarter of the usage keeps the memory and
  stays within 2 points.
- Limits are hard: a team never holds more than ``limit`` slots of a type, a user of a team never
  more than ``user_limit``; a job that would pass one waits, names it, and reserves nothing.
- Preemption reclaims borrowed slots only: a tier-0 job that cannot fit may stop whole running jobs
  of the same slot type whose teams hold more than their guarantee (borrowers), each past
  ``min_runtime_s``, never a job that preempted it (no loops); victims go from the team furthest
  over its guarantee per weight, then lowest priority, then shortest runtime (least work lost), and
  any victim not needed for the fit is spared. Jobs already ``leaving`` count as slots freeing up,
  unless they stop for another queued job (``stopping_for``).
  The preempting job holds the free slots it will use on its chosen agents.

Raises ``ValueError`` for malformed input that would make a placement unsafe: two jobs with one
``job_id``, one agent listed twice for one slot type, or free slot indices that are not sorted,
distinct and within ``0..capacity-1``.

Cost: one pass sorts the jobs, then keeps each slot type's agents in buckets by free count; a job
that cannot run is rejected in O(largest capacity) and a placement costs O(nodes + largest capacity)
plus sorted-list inserts. See ``bench/bench_placement.py``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "AgentSlots",
    "NodePlacement",
    "PendingJob",
    "Placement",
    "PlacementResult",
    "Preemption",
    "RunningJob",
    "Sharing",
    "TeamQuota",
    "never_fits",
    "never_fits_counted",
    "place",
]


@dataclass(frozen=True, slots=True)
class PendingJob:
    job_id: int
    priority: int  # 0..100, higher goes first
    seq: int  # submission order; lower was submitted earlier
    nodes: int  # gang size in nodes (>=1)
    slots_per_node: int  # slots needed on EACH node (>=1)
    slot_type: str  # "cpu" | "gpu"
    team: str = ""  # "" is the queue of jobs without a team
    user: str = ""
    held: bool = False  # an admin holds it: it waits, whatever is free
    preempted_by: int | None = None  # the job whose guarantee stopped this one's last attempt


@dataclass(frozen=True, slots=True)
class TeamQuota:
    """A team's share of the cluster. Slot types missing from a mapping: no guarantee, no limit."""

    weight: float = 1.0  # > 0
    guarantee: Mapping[str, int] = field(default_factory=dict)  # slots it gets back by preemption
    limit: Mapping[str, int] = field(default_factory=dict)  # the most it may hold, borrowing included
    user_limit: Mapping[str, int] = field(default_factory=dict)  # the most one member may hold
    held: bool = False  # an admin holds the team's queue


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job holding slots now (whichever of its states)."""

    job_id: int
    team: str
    user: str
    slot_type: str
    priority: int
    slots: tuple[tuple[int, int], ...]  # (agent_id, slots it holds there)
    runtime_s: float  # since its current attempt started
    leaving: bool = False  # asked to stop already: its slots free up soon
    stopping_for: int | None = None  # leaving because it was preempted for this queued job


@dataclass(frozen=True, slots=True)
class Sharing:
    """What fair sharing needs beyond the queue and the free slots."""

    teams: Mapping[str, TeamQuota] = field(default_factory=dict)  # a team missing here: TeamQuota()
    usage: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (team, slot type) -> decayed slots
    running: Sequence[RunningJob] = ()
    min_runtime_s: float = 0.0  # a job that ran less than this is not preempted
    # How much decayed usage counts against a team beside what it holds now: 0 is Kueue's fair
    # sharing (current holdings only); large values tend to Slurm's (history only). See the doc.
    history_weight: float = 0.25


@dataclass(frozen=True, slots=True)
class Preemption:
    job_id: int  # the running job to stop (whole gang, gracefully; it requeues)
    for_job_id: int  # the job that needs its slots within its team's guarantee
    reason: str  # a sentence for both jobs' events


@dataclass(frozen=True, slots=True)
class AgentSlots:
    """One agent's slots of one type; an agent with cpu and gpu slots appears twice."""

    agent_id: int
    name: str
    slot_type: str
    capacity: int  # all slots of this type on the agent
    free: tuple[int, ...]  # indices (0..capacity-1) of the slots free now, sorted


@dataclass(frozen=True, slots=True)
class NodePlacement:
    node_rank: int
    agent_id: int
    slot_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    job_id: int
    nodes: tuple[NodePlacement, ...]  # node_rank 0..nodes-1, distinct agents


@dataclass(frozen=True, slots=True)
class PlacementResult:
    placements: list[Placement]
    waiting: dict[int, str]  # job_id -> a sentence a user can act on, why it waits now
    # every job that could take a place in line, in the order the pass considered it (queue order)
    order: list[int] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)


# --- wording -------------------------------------------------------------------------------------


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _needs(nodes: int, slots_per_node: int, slot_type: str) -> str:
    slots = _plural(slots_per_node, f"free {slot_type} slot")
    return f"needs {_plural(nodes, 'node')} with {slots}{' each' if nodes > 1 else ''}"


def _have_now(count: int) -> str:
    if count == 0:
        return "no agent has that now"
    return f"{count} agent has that now" if count == 1 else f"{count} agents have that now"


def _names(names: Sequence[str], shown: int = 4) -> str:
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


def _invalid_request(nodes: int, slots_per_node: int) -> str | None:
    if nodes < 1:
        return f"asks for {nodes} nodes; a job needs at least 1 node, so fix resources.nodes and resubmit"
    if slots_per_node < 1:
        return (
            f"asks for {slots_per_node} slots per node; a job needs at least 1 slot on each node, "
            "so fix resources.slots_per_node and resubmit"
        )
    return None


def _never_fits_reason(nodes: int, slots_per_node: int, slot_type: str, offered: bool, big_enough: int) -> str:
    """``offered``: an agent has ``slot_type`` slots; ``big_enough``: agents with enough capacity."""
    if not offered:
        return (
            f"can never run on the current agents: no agent offers {slot_type} slots; "
            f"start an agent with {slot_type} slots or change resources.slot_type"
        )
    only = (
        "no agent has"
        if big_enough == 0
        else f"only {_plural(big_enough, 'agent')} {'has' if big_enough == 1 else 'have'}"
    )
    return (
        f"can never run on the current agents: it needs {_plural(nodes, 'node')} with "
        f"{_plural(slots_per_node, slot_type + ' slot')}{' each' if nodes > 1 else ''}, but {only} "
        f"{slots_per_node} or more {slot_type} slots; lower resources.nodes or resources.slots_per_node, "
        "or add agents"
    )


# --- validation ----------------------------------------------------------------------------------


def _check_agent(agent: AgentSlots) -> None:
    free = agent.free
    if agent.capacity < 0:
        raise ValueError(f"agent {agent.agent_id} ({agent.name}) has a negative {agent.slot_type} capacity")
    if free and (
        free[0] < 0 or free[-1] >= agent.capacity or any(free[i] >= free[i + 1] for i in range(len(free) - 1))
    ):
        raise ValueError(
            f"agent {agent.agent_id} ({agent.name}): free {agent.slot_type} slots {free!r} must be sorted, "
            f"distinct and within 0..{agent.capacity - 1}"
        )


def _group_agents(agents: Sequence[AgentSlots]) -> dict[str, list[AgentSlots]]:
    by_type: dict[str, list[AgentSlots]] = {}
    seen: set[tuple[str, int]] = set()
    for agent in agents:
        key = (agent.slot_type, agent.agent_id)
        if key in seen:
            raise ValueError(f"agent {agent.agent_id} is listed twice for {agent.slot_type} slots")
        seen.add(key)
        _check_agent(agent)
        by_type.setdefault(agent.slot_type, []).append(agent)
    return by_type


# --- the working state of one slot type during one pass -----------------------------------------


class _Pool:
    """The agents of one slot type while one pass places jobs; private and mutable.

    Agents are numbered by their static tie-break order (name, agent_id), so a bucket -- the sorted
    list of agent numbers with exactly ``k`` usable free slots -- lists them in tie-break order, and
    walking buckets upwards from ``slots_per_node`` yields the best-fit order directly.
    """

    __slots__ = ("agents", "at_least_capacity", "buckets", "free", "held", "number_of", "raw_counts")

    def __init__(self, agents: list[AgentSlots]) -> None:
        self.agents = sorted(agents, key=lambda a: (a.name, a.agent_id))
        self.number_of = {agent.agent_id: number for number, agent in enumerate(self.agents)}
        top = max((a.capacity for a in self.agents), default=0)
        # Usable free slots per agent, lowest first; a reservation removes its slots from here.
        self.free: list[list[int]] = [list(a.free) for a in self.agents]
        self.buckets: list[list[int]] = [[] for _ in range(top + 1)]
        for number, agent in enumerate(self.agents):
            self.buckets[len(agent.free)].append(number)  # ascending numbers: already sorted
        # Free counts that ignore the reservation, to tell "blocked by the reservation" from "busy".
        self.raw_counts = [len(bucket) for bucket in self.buckets]
        self.held = [0] * len(self.agents)
        capacity_counts = [0] * (top + 2)
        for agent in self.agents:
            capacity_counts[agent.capacity] += 1
        # at_least_capacity[s]: agents whose capacity is >= s (suffix sums).
        self.at_least_capacity = capacity_counts
        for s in range(top - 1, -1, -1):
            self.at_least_capacity[s] += self.at_least_capacity[s + 1]

    def big_enough(self, slots_per_node: int) -> int:
        """Agents that could give a node ``slots_per_node`` slots once all their slots are free."""
        at_least = self.at_least_capacity
        return at_least[slots_per_node] if slots_per_node < len(at_least) else 0

    def usable_at_least(self, slots_per_node: int) -> int:
        return sum(map(len, self.buckets[slots_per_node:]))

    def free_at_least(self, slots_per_node: int) -> int:
        return sum(self.raw_counts[slots_per_node:])

    def take(self, nodes: int, slots_per_node: int) -> tuple[NodePlacement, ...]:
        """Place a gang the caller has checked fits: best fit, lowest slot indices."""
        buckets = self.buckets
        chosen: list[tuple[int, int]] = []  # (usable free count, agent number), in node-rank order
        missing = nodes
        for count in range(slots_per_node, len(buckets)):
            bucket = buckets[count]
            if bucket:
                taking = min(missing, len(bucket))
                chosen.extend((count, number) for number in bucket[:taking])
                del bucket[:taking]
                missing -= taking
                if missing == 0:
                    break
        nodes_placed: list[NodePlacement] = []
        for rank, (count, number) in enumerate(chosen):
            free = self.free[number]
            slots = tuple(free[:slots_per_node])
            del free[:slots_per_node]
            insort(buckets[count - slots_per_node], number)
            raw = count + self.held[number]
            self.raw_counts[raw] -= 1
            self.raw_counts[raw - slots_per_node] += 1
            nodes_placed.append(NodePlacement(rank, self.agents[number].agent_id, slots))
        return tuple(nodes_placed)

    def reserve(self, nodes: int, slots_per_node: int) -> list[str]:
        """Hold slots for the head of the queue; returns the names of the agents reserved."""
        picked: list[tuple[int, int]] = []
        for count in range(len(self.buckets) - 1, -1, -1):
            for number in self.buckets[count]:
                if self.agents[number].capacity >= slots_per_node:
                    picked.append((count, number))
                    if len(picked) == nodes:
                        break
            if len(picked) == nodes:
                break
        for _, number in picked:
            self.hold(number, slots_per_node)
        return [self.agents[number].name for _, number in picked]

    def hold(self, number: int, slots: int) -> None:
        """Keep up to ``slots`` of the agent's usable free slots from the rest of the pass."""
        count = len(self.free[number])
        holding = min(slots, count)
        if holding:
            bucket = self.buckets[count]
            del bucket[bisect_left(bucket, number)]
            insort(self.buckets[count - holding], number)
            del self.free[number][:holding]
            self.held[number] += holding


# --- the public functions ------------------------------------------------------------------------


def place(jobs: Sequence[PendingJob], agents: Sequence[AgentSlots], sharing: Sharing | None = None) -> PlacementResult:
    """Place as many queued gangs as the free slots allow, in queue order, with one reservation.

    Without ``sharing`` the queue is one line by priority; with it, teams take turns by fair share
    within their quotas, and ``preemptions`` lists the borrowing jobs to stop (see the module doc).
    Placements come in queue order; ``waiting`` holds every job not placed, each with a sentence
    saying why it waits now. Raises ``ValueError`` on malformed input (see the module doc).
    """
    return _Pass(agents, sharing).run(jobs)


_QueueKey = tuple[str, str]  # (team, slot type)


class _Pass:
    """One placement pass: the pools, what each team and user holds, and the decisions so far."""

    def __init__(self, agents: Sequence[AgentSlots], sharing: Sharing | None) -> None:
        self.pools = {slot_type: _Pool(group) for slot_type, group in _group_agents(agents).items()}
        self.sharing = sharing
        self.placements: list[Placement] = []
        self.waiting: dict[int, str] = {}
        self.order: list[int] = []
        self.preemptions: list[Preemption] = []
        self.head: PendingJob | None = None  # the one job holding the backfill reservation
        # What each (team, slot type) and (team, user, slot type) holds, leaving jobs included: limits
        # count every slot held; `borrowing` counts only the jobs not already on their way out.
        self.holds: dict[_QueueKey, int] = {}
        self.user_holds: dict[tuple[str, str, str], int] = {}
        self.staying: dict[_QueueKey, int] = {}
        self.running: list[RunningJob] = []
        # Slots a tier-0 job waits for (its preemption under way): they count against the guarantee
        # of the jobs behind it, so one pass never claims more than the guarantee. And the gang
        # shapes (nodes, slots per node) whose victim search failed this pass, per slot type: a
        # search fails for every shape at least as large too, so a backlog of tier-0 jobs costs
        # a few searches per pass, not one per job (the next pass tries again).
        self.claimed: dict[_QueueKey, int] = {}
        self.queued_ids: set[int] = set()
        self.counted_on: set[int] = set()  # leaving jobs whose slots a waiting job counts on
        self.no_victims: dict[_QueueKey, list[tuple[int, int]]] = {}
        if sharing is not None:
            for run in sorted(sharing.running, key=lambda r: r.job_id):
                size = sum(count for _, count in run.slots)
                key = (run.team, run.slot_type)
                self.holds[key] = self.holds.get(key, 0) + size
                user_key = (run.team, run.user, run.slot_type)
                self.user_holds[user_key] = self.user_holds.get(user_key, 0) + size
                if not run.leaving:
                    self.staying[key] = self.staying.get(key, 0) + size
                self.running.append(run)

    # --- the team rules ---

    def quota(self, team: str) -> TeamQuota:
        assert self.sharing is not None
        return self.sharing.teams.get(team) or _NO_QUOTA

    def share(self, key: _QueueKey) -> float:
        if self.sharing is None:
            return 0.0
        usage = self.sharing.usage.get(key, 0.0) * self.sharing.history_weight
        return (self.holds.get(key, 0) + usage) / self.quota(key[0]).weight

    def tier(self, job: PendingJob) -> int:
        """0: its team can start it within its guarantee (these go first, and may preempt)."""
        if self.sharing is None:
            return 1
        need = job.nodes * job.slots_per_node
        key = (job.team, job.slot_type)
        guarantee = self.quota(job.team).guarantee.get(job.slot_type, 0)
        return 0 if self.holds.get(key, 0) + self.claimed.get(key, 0) + need <= guarantee else 1

    def over_limit(self, job: PendingJob) -> str | None:
        if self.sharing is None:
            return None
        quota, need, kind = self.quota(job.team), job.nodes * job.slots_per_node, job.slot_type
        team = _team_name(job.team)
        limit = quota.limit.get(kind)
        holding = self.holds.get((job.team, kind), 0)
        if limit is not None and holding + need > limit:
            return (
                f"{team}'s limit is {_plural(limit, kind + ' slot')} and it holds {holding}; this job needs "
                f"{need}, so it starts when the team's other jobs free enough (an admin may raise the "
                "limit with `phalanx teams set`)"
            )
        user_limit = quota.user_limit.get(kind)
        user_holding = self.user_holds.get((job.team, job.user, kind), 0)
        if user_limit is not None and user_holding + need > user_limit:
            return (
                f"{job.user or 'its owner'} may hold at most {_plural(user_limit, kind + ' slot')} in "
                f"{team} and holds {user_holding}; this job needs {need}, so it starts when their other "
                "jobs free enough"
            )
        return None

    def held_reason(self, job: PendingJob) -> str | None:
        if job.held:
            return f"held by an admin; it waits until they release it (`phalanx jobs release {job.job_id}`)"
        if self.sharing is not None and job.team and self.quota(job.team).held:
            return (
                f"team {job.team}'s queue is held by an admin; it waits until they release it "
                f"(`phalanx teams release {job.team}`)"
            )
        return None

    # --- the pass ---

    def run(self, jobs: Sequence[PendingJob]) -> PlacementResult:
        self.queued_ids = {job.job_id for job in jobs}
        queues: dict[_QueueKey, list[PendingJob]] = {}
        seen_ids: set[int] = set()
        for job in sorted(jobs, key=lambda job: (-job.priority, job.seq, job.job_id)):
            if job.job_id in seen_ids:
                raise ValueError(f"job {job.job_id} is listed twice")
            seen_ids.add(job.job_id)
            reason = self.cannot_queue(job)
            if reason is not None:
                self.waiting[job.job_id] = reason
                continue
            key = (job.team if self.sharing is not None else "", job.slot_type)
            queues.setdefault(key, []).append(job)
        # Each queue's head competes by (tier, share, its own queue order, team); a placement moves
        # its team's share, so only that queue's head is pushed again with the new key.
        positions = dict.fromkeys(queues, 0)
        heap: list[tuple[int, float, int, int, int, str, str]] = []

        def push(key: _QueueKey) -> None:
            queue, at = queues[key], positions[key]
            if at < len(queue):
                job = queue[at]
                heapq.heappush(heap, (self.tier(job), self.share(key), -job.priority, job.seq, job.job_id, *key))

        for key in queues:
            push(key)
        while heap:
            *_, team, slot_type = heapq.heappop(heap)
            key = (team, slot_type)
            job = queues[key][positions[key]]
            positions[key] += 1
            self.order.append(job.job_id)
            self.consider(job)
            push(key)
        return PlacementResult(
            placements=self.placements, waiting=self.waiting, order=self.order, preemptions=self.preemptions
        )

    def cannot_queue(self, job: PendingJob) -> str | None:
        """Why the job takes no place in line: held, malformed, or never fits these agents."""
        held = self.held_reason(job)
        if held is not None:
            return held
        invalid = _invalid_request(job.nodes, job.slots_per_node)
        if invalid is not None:
            return invalid
        pool = self.pools.get(job.slot_type)
        if pool is None:
            return _never_fits_reason(job.nodes, job.slots_per_node, job.slot_type, False, 0)
        big_enough = pool.big_enough(job.slots_per_node)
        if big_enough < job.nodes:
            return _never_fits_reason(job.nodes, job.slots_per_node, job.slot_type, True, big_enough)
        return None

    def consider(self, job: PendingJob) -> None:
        job_id, nodes, per_node, kind = job.job_id, job.nodes, job.slots_per_node, job.slot_type
        pool = self.pools[kind]
        over = self.over_limit(job)
        if over is not None:
            self.waiting[job_id] = over
            return
        tier = self.tier(job)
        if pool.usable_at_least(per_node) >= nodes:
            self.placements.append(Placement(job_id, pool.take(nodes, per_node)))
            self.count_in(job)
            return
        key = (job.team, kind)
        failed = self.no_victims.setdefault(key, [])
        if tier == 0 and not any(nodes >= n and per_node >= s for n, s in failed):
            if self.try_preemption(job, pool):
                self.claimed[key] = self.claimed.get(key, 0) + nodes * per_node
                return
            failed.append((nodes, per_node))
        free_now = pool.free_at_least(per_node)
        head = self.head
        if head is None:
            self.head = job
            names = pool.reserve(nodes, per_node)
            self.waiting[job_id] = (
                f"{_needs(nodes, per_node, kind)}; {_have_now(free_now)}. It is first in line, so "
                f"{_names(names)} {'is' if len(names) == 1 else 'are'} reserved for it: smaller jobs may "
                f"not take the free {kind} slots it will use there"
            )
        elif free_now >= nodes:  # it would fit, were it not for a reservation (of its slot type)
            self.waiting[job_id] = (
                f"waiting behind job {head.job_id} (priority {head.priority}), which holds a reservation "
                f"on the free {kind} slots this job could use; it starts when job {head.job_id} "
                f"has started or more {kind} slots free up"
            )
        else:
            self.waiting[job_id] = f"{_needs(nodes, per_node, kind)}; {_have_now(free_now)}"

    def count_in(self, job: PendingJob) -> None:
        size = job.nodes * job.slots_per_node
        key = (job.team if self.sharing is not None else "", job.slot_type)
        self.holds[key] = self.holds.get(key, 0) + size
        self.staying[key] = self.staying.get(key, 0) + size
        user_key = (key[0], job.user, job.slot_type)
        self.user_holds[user_key] = self.user_holds.get(user_key, 0) + size

    # --- preemption ---

    def try_preemption(self, job: PendingJob, pool: _Pool) -> bool:
        """A tier-0 job that does not fit: wait for leaving jobs, or pick borrowers to stop.

        True when the job's wait is decided here (it holds its slots); False when no set of
        preemptible jobs would make room, and the job waits like any other."""
        assert self.sharing is not None
        nodes, per_node, kind = job.nodes, job.slots_per_node, job.slot_type
        counts = [len(free) for free in pool.free]  # usable free slots per agent number
        enough = sum(1 for count in counts if count >= per_node)

        def add(run: RunningJob, sign: int) -> None:
            nonlocal enough
            for agent_id, slots in run.slots:
                number = pool.number_of.get(agent_id)
                if number is None:
                    continue  # an agent no longer offered (draining, lost): freeing it does not help
                before = counts[number] >= per_node
                counts[number] += sign * slots
                enough += (counts[number] >= per_node) - before

        # Slots freeing up count for this job, those stopping for it first, unless another queued
        # job preempted them for itself or an earlier job of this pass counts on them already:
        # two jobs waiting on the same slots would each preempt too little.
        leaving = sorted(
            (
                run
                for run in self.running
                if run.leaving
                and run.slot_type == kind
                and run.job_id not in self.counted_on
                and (run.stopping_for in (None, job.job_id) or run.stopping_for not in self.queued_ids)
            ),
            key=lambda run: (run.stopping_for != job.job_id, run.job_id),
        )
        waiting_on: list[RunningJob] = []
        for run in leaving:
            if enough >= nodes:
                break
            add(run, +1)
            waiting_on.append(run)
        victims: list[RunningJob] = []
        if enough < nodes:
            for run in self.preemptible(job):
                add(run, +1)
                victims.append(run)
                if enough >= nodes:
                    break
            if enough < nodes:
                return False
            for run in reversed(list(victims)):  # spare every victim the fit does not need
                add(run, -1)
                if enough >= nodes:
                    victims.remove(run)
                else:
                    add(run, +1)
        self.counted_on.update(run.job_id for run in waiting_on)
        # Hold the free slots of the agents it will use, so the rest of this pass cannot take them.
        chosen = sorted(
            (number for number, count in enumerate(counts) if count >= per_node),
            key=lambda number: (-counts[number], self.pools[kind].agents[number].name, number),
        )[:nodes]
        for number in chosen:
            pool.hold(number, per_node)
        team = _team_name(job.team)
        guarantee = self.quota(job.team).guarantee.get(kind, 0)
        if victims:
            for run in victims:
                self.preempt(run, job, team, guarantee)
            stopping = ", ".join(f"job {run.job_id}" for run in victims)
            self.waiting[job.job_id] = (
                f"runs within {team}'s guarantee of {_plural(guarantee, kind + ' slot')}, so {stopping} "
                f"(borrowing those slots) {'is' if len(victims) == 1 else 'are'} being preempted for it; it "
                "starts once they have checkpointed and stopped"
            )
        else:
            names = _names([f"job {run.job_id}" for run in waiting_on])
            self.waiting[job.job_id] = (
                f"runs within {team}'s guarantee of {_plural(guarantee, kind + ' slot')}; waiting for "
                f"{names or 'stopping jobs'} to stop, whose slots it will take"
            )
        return True

    def preemptible(self, job: PendingJob) -> list[RunningJob]:
        """Running jobs of borrowing teams that may be stopped for ``job``, best victims first."""
        assert self.sharing is not None
        kind = job.slot_type
        min_runtime = self.sharing.min_runtime_s

        def borrowed(team: str) -> int:
            return self.staying.get((team, kind), 0) - self.quota(team).guarantee.get(kind, 0)

        candidates = [
            run
            for run in self.running
            if run.slot_type == kind
            and not run.leaving
            and run.team != job.team
            and run.runtime_s >= min_runtime
            and run.job_id != job.preempted_by
            and borrowed(run.team) > 0
        ]
        return sorted(
            candidates,
            key=lambda run: (
                -borrowed(run.team) / self.quota(run.team).weight,
                run.priority,
                run.runtime_s,
                -run.job_id,
            ),
        )

    def preempt(self, run: RunningJob, job: PendingJob, team: str, guarantee: int) -> None:
        size = sum(count for _, count in run.slots)
        key = (run.team, run.slot_type)
        self.staying[key] = self.staying.get(key, 0) - size
        self.running = [r if r is not run else _leaving(r, job.job_id) for r in self.running]
        self.preemptions.append(
            Preemption(
                job_id=run.job_id,
                for_job_id=job.job_id,
                reason=(
                    f"job {run.job_id} of {_team_name(run.team)} borrowed {run.slot_type} slots that job "
                    f"{job.job_id} of {team} needs within its guarantee of "
                    f"{_plural(guarantee, run.slot_type + ' slot')}: it checkpoints, stops and queues again"
                ),
            )
        )


_NO_QUOTA = TeamQuota()


def _team_name(team: str) -> str:
    return f"team {team}" if team else "the jobs without a team"


def _leaving(run: RunningJob, stopping_for: int) -> RunningJob:
    return replace(run, leaving=True, stopping_for=stopping_for)


def never_fits(nodes: int, slots_per_node: int, slot_type: str, agents: Sequence[AgentSlots]) -> str | None:
    """None if some set of these agents could host the gang when all their slots are free; else a reason.

    Raises ``ValueError`` on malformed agents (see the module doc).
    """
    of_type = _group_agents(agents).get(slot_type, [])
    big_enough = sum(1 for agent in of_type if agent.capacity >= slots_per_node)
    return never_fits_counted(nodes, slots_per_node, slot_type, len(of_type), big_enough)


def never_fits_counted(
    nodes: int, slots_per_node: int, slot_type: str, agents_of_type: int, big_enough: int
) -> str | None:
    """`never_fits` from two counts: the agents that offer `slot_type`, and how many of them have at
    least `slots_per_node` of it (a database can count them without sending every agent)."""
    invalid = _invalid_request(nodes, slots_per_node)
    if invalid is not None:
        return invalid
    if agents_of_type and big_enough >= nodes:
        return None
    return _never_fits_reason(nodes, slots_per_node, slot_type, bool(agents_of_type), big_enough)
