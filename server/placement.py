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

Raises ``ValueError`` for malformed input that would make a placement unsafe: two jobs with one
``job_id``, one agent listed twice for one slot type, or free slot indices that are not sorted,
distinct and within ``0..capacity-1``.

Cost: one pass sorts the jobs, then keeps each slot type's agents in buckets by free count; a job
that cannot run is rejected in O(largest capacity) and a placement costs O(nodes + largest capacity)
plus sorted-list inserts. See ``bench/bench_placement.py``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AgentSlots",
    "NodePlacement",
    "PendingJob",
    "Placement",
    "PlacementResult",
    "never_fits",
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

    __slots__ = ("agents", "at_least_capacity", "buckets", "free", "held", "raw_counts")

    def __init__(self, agents: list[AgentSlots]) -> None:
        self.agents = sorted(agents, key=lambda a: (a.name, a.agent_id))
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
        for count, number in picked:
            holding = min(slots_per_node, count)
            if holding:
                bucket = self.buckets[count]
                del bucket[bisect_left(bucket, number)]
                insort(self.buckets[count - holding], number)
                del self.free[number][:holding]
                self.held[number] = holding
        return [self.agents[number].name for _, number in picked]


# --- the public functions ------------------------------------------------------------------------


def place(jobs: Sequence[PendingJob], agents: Sequence[AgentSlots]) -> PlacementResult:
    """Place as many queued gangs as the free slots allow, in queue order, with one reservation.

    Placements come in queue order; ``waiting`` holds every job not placed, in queue order, each with
    a sentence saying why it waits now. Raises ``ValueError`` on malformed input (see the module doc).
    """
    pools = {slot_type: _Pool(group) for slot_type, group in _group_agents(agents).items()}
    queue = sorted(jobs, key=lambda job: (-job.priority, job.seq, job.job_id))
    seen_ids: set[int] = set()
    placements: list[Placement] = []
    waiting: dict[int, str] = {}
    head: PendingJob | None = None  # the one job holding a reservation
    for job in queue:
        job_id = job.job_id
        if job_id in seen_ids:
            raise ValueError(f"job {job_id} is listed twice")
        seen_ids.add(job_id)
        nodes = job.nodes
        per_node = job.slots_per_node
        invalid = _invalid_request(nodes, per_node)
        if invalid is not None:
            waiting[job_id] = invalid
            continue
        pool = pools.get(job.slot_type)
        if pool is None:
            waiting[job_id] = _never_fits_reason(nodes, per_node, job.slot_type, False, 0)
            continue
        big_enough = pool.big_enough(per_node)
        if big_enough < nodes:
            waiting[job_id] = _never_fits_reason(nodes, per_node, job.slot_type, True, big_enough)
            continue
        if pool.usable_at_least(per_node) >= nodes:
            placements.append(Placement(job_id, pool.take(nodes, per_node)))
            continue
        free_now = pool.free_at_least(per_node)
        if head is None:
            head = job
            names = pool.reserve(nodes, per_node)
            waiting[job_id] = (
                f"{_needs(nodes, per_node, job.slot_type)}; {_have_now(free_now)}. It is first in line, so "
                f"{_names(names)} {'is' if len(names) == 1 else 'are'} reserved for it: smaller jobs may "
                f"not take the free {job.slot_type} slots it will use there"
            )
        elif free_now >= nodes:  # it would fit, were it not for the reservation (of its slot type)
            waiting[job_id] = (
                f"waiting behind job {head.job_id} (priority {head.priority}), which holds a reservation "
                f"on the free {job.slot_type} slots this job could use; it starts when job {head.job_id} "
                f"has started or more {job.slot_type} slots free up"
            )
        else:
            waiting[job_id] = f"{_needs(nodes, per_node, job.slot_type)}; {_have_now(free_now)}"
    return PlacementResult(placements=placements, waiting=waiting)


def never_fits(nodes: int, slots_per_node: int, slot_type: str, agents: Sequence[AgentSlots]) -> str | None:
    """None if some set of these agents could host the gang when all their slots are free; else a reason.

    Raises ``ValueError`` on malformed agents (see the module doc).
    """
    invalid = _invalid_request(nodes, slots_per_node)
    if invalid is not None:
        return invalid
    of_type = _group_agents(agents).get(slot_type, [])
    big_enough = sum(1 for agent in of_type if agent.capacity >= slots_per_node)
    if of_type and big_enough >= nodes:
        return None
    return _never_fits_reason(nodes, slots_per_node, slot_type, bool(of_type), big_enough)
