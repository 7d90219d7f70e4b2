"""Gang placement: property tests against a naive reference, then examples of each rule."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.placement import (
    AgentSlots,
    NodePlacement,
    PendingJob,
    Placement,
    PlacementResult,
    never_fits,
    place,
)

PROPERTY = settings(max_examples=200, deadline=None)

# --- strategies ----------------------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> list[AgentSlots]:
    count = draw(st.integers(0, 8))
    ids = draw(st.lists(st.integers(1, 500), unique=True, min_size=count, max_size=count))
    agents: list[AgentSlots] = []
    for agent_id in ids:
        name = draw(st.sampled_from(["a", "b", "c", "d"]))  # few names, so ties reach agent_id
        for slot_type in sorted(draw(st.sets(st.sampled_from(["cpu", "gpu"]), min_size=1))):
            capacity = draw(st.integers(0, 8))
            free = draw(st.sets(st.integers(0, capacity - 1))) if capacity else set()
            agents.append(AgentSlots(agent_id, name, slot_type, capacity, tuple(sorted(free))))
    return agents


jobs_strategy = st.lists(
    st.builds(
        PendingJob,
        job_id=st.integers(1, 10_000),
        priority=st.sampled_from([0, 50, 80, 100]),
        seq=st.integers(0, 20),  # repeats on purpose: job_id must break the tie
        nodes=st.integers(1, 4),
        slots_per_node=st.integers(1, 9),  # 9 > any capacity: some jobs never fit
        slot_type=st.sampled_from(["cpu", "cpu", "gpu", "tpu"]),
    ),
    unique_by=lambda job: job.job_id,
    max_size=25,
)

# --- a naive reference: the rules written as plainly as possible ----------------------------------


@dataclass
class Reference:
    placements: list[tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]] = field(default_factory=list)
    waiting: set[int] = field(default_factory=set)
    head: PendingJob | None = None
    reserved: set[tuple[str, int, int]] = field(default_factory=set)  # (slot_type, agent_id, index)


def queue_order(jobs: Sequence[PendingJob]) -> list[PendingJob]:
    return sorted(jobs, key=lambda job: (-job.priority, job.seq, job.job_id))


def reference_place(jobs: Sequence[PendingJob], agents: Sequence[AgentSlots]) -> Reference:
    usable = {(a.slot_type, a.agent_id): list(a.free) for a in agents}
    ref = Reference()
    for job in queue_order(jobs):
        of_type = [a for a in agents if a.slot_type == job.slot_type]
        big_enough = [a for a in of_type if a.capacity >= job.slots_per_node]
        if len(big_enough) < job.nodes:
            ref.waiting.add(job.job_id)
            continue
        candidates = sorted(
            (len(usable[(a.slot_type, a.agent_id)]), a.name, a.agent_id)
            for a in of_type
            if len(usable[(a.slot_type, a.agent_id)]) >= job.slots_per_node
        )
        if len(candidates) >= job.nodes:
            nodes = []
            for _, _, agent_id in candidates[: job.nodes]:
                free = usable[(job.slot_type, agent_id)]
                nodes.append((agent_id, tuple(free[: job.slots_per_node])))
                del free[: job.slots_per_node]
            ref.placements.append((job.job_id, tuple(nodes)))
            continue
        ref.waiting.add(job.job_id)
        if ref.head is None:
            ref.head = job
            by_most_free = sorted(
                big_enough, key=lambda a: (-len(usable[(a.slot_type, a.agent_id)]), a.name, a.agent_id)
            )
            for agent in by_most_free[: job.nodes]:
                free = usable[(agent.slot_type, agent.agent_id)]
                ref.reserved.update((agent.slot_type, agent.agent_id, i) for i in free[: job.slots_per_node])
                del free[: job.slots_per_node]
    return ref


def as_tuples(result: PlacementResult) -> list[tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]]:
    return [(p.job_id, tuple((n.agent_id, n.slot_indices) for n in p.nodes)) for p in result.placements]


def fits(job: PendingJob, free: dict[tuple[str, int], set[int]]) -> bool:
    hosts = [key for key, slots in free.items() if key[0] == job.slot_type and len(slots) >= job.slots_per_node]
    return len(hosts) >= job.nodes


def slots_of(placement: Placement, slot_type: str) -> set[tuple[str, int, int]]:
    return {(slot_type, node.agent_id, i) for node in placement.nodes for i in node.slot_indices}


# --- properties ----------------------------------------------------------------------------------


@PROPERTY
@given(jobs=jobs_strategy, agents=clusters())
def test_placements_respect_every_hard_constraint(jobs: list[PendingJob], agents: list[AgentSlots]) -> None:
    result = place(jobs, agents)
    by_id = {job.job_id: job for job in jobs}
    agent_by_key = {(a.slot_type, a.agent_id): a for a in agents}
    given_out: set[tuple[str, int, int]] = set()
    placed_ids = [p.job_id for p in result.placements]

    # All or nothing: each job is placed whole or waits, exactly once.
    assert len(placed_ids) == len(set(placed_ids))
    assert set(placed_ids).isdisjoint(result.waiting)
    assert set(placed_ids) | set(result.waiting) == set(by_id)

    for placement in result.placements:
        job = by_id[placement.job_id]
        assert [n.node_rank for n in placement.nodes] == list(range(job.nodes))
        assert len({n.agent_id for n in placement.nodes}) == job.nodes  # distinct agents
        for node in placement.nodes:
            agent = agent_by_key[(job.slot_type, node.agent_id)]  # the right slot type
            assert len(node.slot_indices) == job.slots_per_node
            assert set(node.slot_indices) <= set(agent.free)
            for index in node.slot_indices:
                slot = (job.slot_type, node.agent_id, index)
                assert slot not in given_out, f"slot {slot} given twice"
                given_out.add(slot)
    for reason in result.waiting.values():
        assert reason and reason[0].islower() and "\n" not in reason


@PROPERTY
@given(jobs=jobs_strategy, agents=clusters())
def test_matches_the_naive_reference(jobs: list[PendingJob], agents: list[AgentSlots]) -> None:
    """Same gangs on the same agents with the same slots and node ranks: best fit and tie-breaks."""
    result = place(jobs, agents)
    ref = reference_place(jobs, agents)
    assert as_tuples(result) == ref.placements
    assert set(result.waiting) == ref.waiting


@PROPERTY
@given(jobs=jobs_strategy, agents=clusters())
def test_no_waiting_job_could_have_used_slots_given_to_a_job_behind_it(
    jobs: list[PendingJob], agents: list[AgentSlots]
) -> None:
    """Priority order: a waiting job does not fit in what was left plus what later jobs got.

    Only the head's reservation may keep a job behind it from slots it would fit in, and the reason
    says which of the two keeps it waiting.
    """
    result = place(jobs, agents)
    ref = reference_place(jobs, agents)
    placed = {p.job_id: p for p in result.placements}
    by_id = {job.job_id: job for job in jobs}
    order = queue_order(jobs)
    head_position = order.index(ref.head) if ref.head is not None else len(order)
    for position, job in enumerate(order):
        if job.job_id not in result.waiting:
            continue
        free = {(a.slot_type, a.agent_id): set(a.free) for a in agents}
        for earlier in order[:position]:
            if earlier.job_id in placed:
                for slot_type, agent_id, index in slots_of(placed[earlier.job_id], by_id[earlier.job_id].slot_type):
                    free[(slot_type, agent_id)].discard(index)
        reason = result.waiting[job.job_id]
        if reason.startswith(("can never run", "asks for")):
            continue
        # The reason tells how many agents have enough free slots now, reservation or not ...
        have = sum(1 for key, slots in free.items() if key[0] == job.slot_type and len(slots) >= job.slots_per_node)
        if have < job.nodes or position <= head_position:
            now = "no agent has" if have == 0 else f"{have} agent has" if have == 1 else f"{have} agents have"
            assert reason.startswith(f"needs {job.nodes} node"), reason
            assert f"; {now} that now" in reason, reason
        else:  # ... or that only the reservation stands in the way.
            assert ref.head is not None
            assert reason.startswith(f"waiting behind job {ref.head.job_id} (priority {ref.head.priority})")
        if position > head_position:
            for slot_type, agent_id, index in ref.reserved:
                free[(slot_type, agent_id)].discard(index)
        assert not fits(job, free), f"job {job.job_id} waits although it fits: {reason}"


@PROPERTY
@given(jobs=jobs_strategy, agents=clusters())
def test_backfill_never_takes_reserved_slots(jobs: list[PendingJob], agents: list[AgentSlots]) -> None:
    result = place(jobs, agents)
    ref = reference_place(jobs, agents)
    by_id = {job.job_id: job for job in jobs}
    for placement in result.placements:
        assert slots_of(placement, by_id[placement.job_id].slot_type).isdisjoint(ref.reserved)
    if ref.head is not None:
        assert "first in line" in result.waiting[ref.head.job_id]


@PROPERTY
@given(jobs=jobs_strategy, agents=clusters())
def test_never_fit_reasons_agree_with_never_fits(jobs: list[PendingJob], agents: list[AgentSlots]) -> None:
    result = place(jobs, agents)
    for job in jobs:
        reason = never_fits(job.nodes, job.slots_per_node, job.slot_type, agents)
        if reason is not None:
            assert result.waiting[job.job_id] == reason
        else:
            assert not result.waiting.get(job.job_id, "").startswith("can never run")


@PROPERTY
@given(jobs=jobs_strategy, agents=clusters(), shuffle=st.randoms(use_true_random=False))
def test_same_input_in_any_order_gives_the_same_output(
    jobs: list[PendingJob], agents: list[AgentSlots], shuffle: random.Random
) -> None:
    shuffled_jobs, shuffled_agents = list(jobs), list(agents)
    shuffle.shuffle(shuffled_jobs)
    shuffle.shuffle(shuffled_agents)
    first, second = place(jobs, agents), place(tuple(shuffled_jobs), tuple(shuffled_agents))
    assert first == second
    assert list(first.waiting.items()) == list(second.waiting.items())


@PROPERTY
@given(jobs=jobs_strategy, agents=clusters())
def test_inputs_are_not_mutated(jobs: list[PendingJob], agents: list[AgentSlots]) -> None:
    jobs_before, agents_before = copy.deepcopy(jobs), copy.deepcopy(agents)
    place(jobs, agents)
    never_fits(2, 2, "cpu", agents)
    assert jobs == jobs_before
    assert agents == agents_before


# --- examples ------------------------------------------------------------------------------------


def cpu(agent_id: int, name: str, free: Sequence[int], capacity: int = 8) -> AgentSlots:
    return AgentSlots(agent_id, name, "cpu", capacity, tuple(free))


def gpu(agent_id: int, name: str, free: Sequence[int], capacity: int = 8) -> AgentSlots:
    return AgentSlots(agent_id, name, "gpu", capacity, tuple(free))


def job(
    job_id: int,
    nodes: int = 1,
    slots: int = 1,
    *,
    priority: int = 50,
    seq: int | None = None,
    kind: str = "cpu",
) -> PendingJob:
    return PendingJob(job_id, priority, job_id if seq is None else seq, nodes, slots, kind)


def nodes_of(result: PlacementResult, job_id: int) -> list[tuple[int, tuple[int, ...]]]:
    (placement,) = [p for p in result.placements if p.job_id == job_id]
    return [(n.agent_id, n.slot_indices) for n in placement.nodes]


def test_higher_priority_goes_first_even_when_submitted_later() -> None:
    result = place([job(1, slots=4, priority=10), job(2, slots=4, priority=90)], [cpu(7, "n", range(4))])
    assert [p.job_id for p in result.placements] == [2]
    assert set(result.waiting) == {1}


def test_fifo_within_a_priority_then_job_id() -> None:
    agents = [cpu(7, "n", range(4))]
    assert [p.job_id for p in place([job(1, slots=4, seq=5), job(2, slots=4, seq=3)], agents).placements] == [2]
    same_seq = [job(9, slots=4, seq=1), job(4, slots=4, seq=1)]
    assert [p.job_id for p in place(same_seq, agents).placements] == [4]


def test_best_fit_takes_the_smallest_sufficient_hole_and_the_lowest_slots() -> None:
    agents = [cpu(1, "big", range(8)), cpu(2, "mid", [0, 2, 4, 6]), cpu(3, "small", [5, 6])]
    result = place([job(10, slots=2), job(11, nodes=2, slots=3, seq=20)], agents)
    assert nodes_of(result, 10) == [(3, (5, 6))]
    # Rank 0 is the first agent in best-fit order: mid (4 free) before big (8 free).
    assert nodes_of(result, 11) == [(2, (0, 2, 4)), (1, (0, 1, 2))]
    assert result.placements[1].nodes[0] == NodePlacement(0, 2, (0, 2, 4))


def test_ties_break_on_name_then_agent_id() -> None:
    result = place([job(1), job(2)], [cpu(5, "b", [0]), cpu(9, "a", [0]), cpu(3, "b", [1])])
    assert nodes_of(result, 1) == [(9, (0,))]
    assert nodes_of(result, 2) == [(3, (1,))]


def test_an_agent_with_cpu_and_gpu_slots_hosts_both_kinds() -> None:
    agents = [cpu(1, "n", range(2)), gpu(1, "n", range(2))]
    result = place([job(1, slots=2), job(2, slots=2, kind="gpu")], agents)
    assert nodes_of(result, 1) == [(1, (0, 1))] and nodes_of(result, 2) == [(1, (0, 1))]


def test_a_gang_is_placed_whole_or_not_at_all() -> None:
    result = place([job(1, nodes=3, slots=2)], [cpu(1, "a", range(8)), cpu(2, "b", range(2)), cpu(3, "c", [0])])
    assert result.placements == []
    assert result.waiting[1].startswith("needs 3 nodes with 2 free cpu slots each; 2 agents have that now.")


def test_backfill_allowed_outside_the_reservation() -> None:
    # Head job 1 needs 2x6: only "a" has 6 free. It reserves a (6 of 8) and b (its 4).
    agents = [cpu(1, "a", range(8)), cpu(2, "b", range(4))]
    jobs = [job(1, nodes=2, slots=6, priority=80), job(2, slots=2, priority=10), job(3, slots=7, priority=10)]
    result = place(jobs, agents)
    assert nodes_of(result, 2) == [(1, (6, 7))]
    # After job 2, a has 6 free slots in all (reserved or not): job 3 waits for slots, not the head.
    assert result.waiting[3] == "needs 1 node with 7 free cpu slots; no agent has that now"
    assert result.waiting[1] == (
        "needs 2 nodes with 6 free cpu slots each; 1 agent has that now. It is first in line, so a, b are "
        "reserved for it: smaller jobs may not take the free cpu slots it will use there"
    )


def test_backfill_refused_when_it_would_take_reserved_slots() -> None:
    agents = [cpu(1, "a", range(8)), cpu(2, "b", range(4))]
    result = place([job(1, nodes=2, slots=6, priority=80), job(2, slots=3, priority=10)], agents)
    assert result.placements == []
    assert result.waiting[2].startswith("waiting behind job 1 (priority 80), which holds a reservation")


def test_only_the_first_blocked_job_reserves() -> None:
    # Job 1 (gpu) is the head; job 2 (cpu) is blocked too but holds nothing, so job 3 takes c1's slots.
    agents = [gpu(1, "g1", [0, 1]), cpu(2, "c1", range(4)), cpu(3, "c2", [])]
    jobs = [job(1, slots=4, kind="gpu", priority=90), job(2, nodes=2, slots=4, priority=80), job(3, slots=4)]
    result = place(jobs, agents)
    assert nodes_of(result, 3) == [(2, (0, 1, 2, 3))]
    assert "first in line" in result.waiting[1]
    assert result.waiting[2] == "needs 2 nodes with 4 free cpu slots each; 1 agent has that now"


def test_the_reservation_prefers_the_agents_with_most_free_slots() -> None:
    agents = [cpu(1, "x", [0]), cpu(2, "y", range(3)), cpu(3, "w", range(3)), cpu(4, "z", [])]
    result = place([job(1, nodes=2, slots=4), job(2, slots=1, seq=9)], agents)
    assert "so w, y are reserved for it" in result.waiting[1]
    assert nodes_of(result, 2) == [(1, (0,))]  # x's slot was not held


def test_jobs_that_can_never_fit_say_so_and_do_not_reserve() -> None:
    agents = [gpu(1, "g1", range(8)), gpu(2, "g2", []), cpu(3, "c", [0])]
    jobs = [
        job(1, nodes=3, slots=8, kind="gpu", priority=100),
        job(2, slots=2, kind="tpu", priority=100),
        job(3, nodes=2, slots=8, kind="gpu", priority=50),
        job(4, slots=8, kind="gpu", priority=10),
    ]
    result = place(jobs, agents)
    assert result.waiting[1] == (
        "can never run on the current agents: it needs 3 nodes with 8 gpu slots each, but only 2 agents "
        "have 8 or more gpu slots; lower resources.nodes or resources.slots_per_node, or add agents"
    )
    assert result.waiting[2].startswith("can never run on the current agents: no agent offers tpu slots")
    assert "first in line" in result.waiting[3]  # the first job that can ever run holds the reservation
    assert result.waiting[4].startswith("waiting behind job 3 (priority 50)")


def test_never_fits() -> None:
    agents = [gpu(1, "g1", []), gpu(2, "g2", [], capacity=4), cpu(3, "c", [])]
    assert never_fits(1, 8, "gpu", agents) is None  # busy now, but it could run once g1 is free
    assert never_fits(2, 4, "gpu", agents) is None
    assert never_fits(2, 8, "gpu", agents) == (
        "can never run on the current agents: it needs 2 nodes with 8 gpu slots each, but only 1 agent "
        "has 8 or more gpu slots; lower resources.nodes or resources.slots_per_node, or add agents"
    )
    assert "no agent has 9 or more cpu slots" in (never_fits(1, 9, "cpu", agents) or "")
    assert "no agent offers gpu slots" in (never_fits(1, 1, "gpu", []) or "")
    assert (never_fits(0, 1, "cpu", agents) or "").startswith("asks for 0 nodes")
    assert (never_fits(1, 0, "cpu", agents) or "").startswith("asks for 0 slots per node")


def test_invalid_requests_wait_with_a_reason_instead_of_failing_the_pass() -> None:
    result = place([job(1, nodes=0), job(2, slots=0), job(3)], [cpu(1, "a", [0])])
    assert result.waiting[1].startswith("asks for 0 nodes")
    assert result.waiting[2].startswith("asks for 0 slots per node")
    assert nodes_of(result, 3) == [(1, (0,))]


@pytest.mark.parametrize(
    ("jobs", "agents", "message"),
    [
        ([job(1), job(1, seq=4)], [], "job 1 is listed twice"),
        ([], [cpu(1, "a", [0]), cpu(1, "b", [1])], "agent 1 is listed twice for cpu slots"),
        ([], [cpu(1, "a", [1, 0])], "must be sorted, distinct and within 0..7"),
        ([], [cpu(1, "a", [0, 0])], "must be sorted, distinct"),
        ([], [cpu(1, "a", [8])], "within 0..7"),
        ([], [cpu(1, "a", [-1])], "within 0..7"),
    ],
)
def test_malformed_input_is_refused(jobs: list[PendingJob], agents: list[AgentSlots], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        place(jobs, agents)


def test_empty_input() -> None:
    assert place([], []) == PlacementResult(placements=[], waiting={})
