"""The server's summary of a rank's profiler trace: compute, communication, their overlap and idle
time per step, on hand-made traces whose answers are known, on a real torch.profiler trace, and as
properties of any trace (the parts add up to the window, overlap never exceeds either side)."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from server.trace_summary import (
    TraceRefused,
    intersect,
    length,
    read_events,
    subtract,
    summarise,
    summarise_bytes,
    union,
)

MAIN, GLOO = 100, 101


def op(name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def gz(events: list[dict[str, Any]]) -> bytes:
    return gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": events}).encode())


def test_a_cpu_step_splits_into_compute_hidden_and_exposed_communication_and_idle() -> None:
    # two steps of 100 us: compute 0-60, an all-reduce on gloo's thread 40-90 (20 hidden, 30
    # exposed), nothing 90-100; the main thread's own dispatch of the collective counts as comm
    events = []
    for start in (0.0, 100.0):
        events += [
            op("ProfilerStep#1", start, 100, cat="user_annotation"),
            op("aten::addmm", start, 60),
            op("c10d::allreduce_", start + 55, 5),
            op("gloo:all_reduce", start + 40, 50, tid=GLOO, cat="user_annotation"),
            op("aten::empty", start + 200, 10),  # outside every step: left out
        ]
    summary = summarise_bytes(gz(events))
    assert summary.device == "cpu" and summary.steps == 2
    assert summary.step_time_s == pytest.approx(100e-6)
    assert summary.compute_s == pytest.approx(55e-6)  # 0-55 (55-60 was the dispatch)
    assert summary.comm_s == pytest.approx(50e-6)  # 40-90
    assert summary.overlap_s == pytest.approx(15e-6)  # 40-55
    assert summary.exposed_comm_s == pytest.approx(35e-6)
    assert summary.idle_s == pytest.approx(10e-6)


def test_on_a_gpu_the_kernels_count_and_nccl_kernels_are_communication() -> None:
    events = [
        op("ProfilerStep#7", 0, 1000, cat="user_annotation"),
        op("aten::mm", 0, 1000),  # the host is busy all step: on a GPU it does not count
        op("ampere_sgemm_128x64", 100, 400, tid=7, cat="kernel"),
        op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 500, tid=8, cat="kernel"),
    ]
    summary = summarise(events)
    assert summary.device == "cuda"
    assert summary.compute_s == pytest.approx(400e-6)
    assert summary.comm_s == pytest.approx(500e-6)
    assert summary.overlap_s == pytest.approx(200e-6)
    assert summary.idle_s == pytest.approx(300e-6)  # 0-100 and 800-1000


def test_a_trace_without_step_marks_uses_its_whole_span_as_one_step() -> None:
    summary = summarise([op("aten::mm", 10, 30), op("aten::add", 60, 40)])
    assert summary.steps == 0
    assert summary.step_time_s == pytest.approx(90e-6)
    assert summary.idle_s == pytest.approx(20e-6)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"not gzip at all", "not a gzipped Chrome trace"),
        (gzip.compress(b'{"traceEvents": [1, 2'), "not a gzipped Chrome trace"),
        (gz([]), "no timed events"),
        (gz([{"ph": "X", "ts": "soon", "dur": 1}, {"ph": "X", "ts": 1.0, "dur": -5}]), "no timed events"),
    ],
)
def test_what_is_no_trace_is_refused_with_what_to_do(body: bytes, says: str) -> None:
    with pytest.raises(TraceRefused, match=says):
        summarise_bytes(body)


def test_a_trace_that_unpacks_past_the_cap_is_refused_as_it_streams() -> None:
    body = gz([op("aten::mm", float(i), 1.0) for i in range(2000)])
    with pytest.raises(TraceRefused, match="unpacks to more than"):
        list(read_events(io.BytesIO(body), max_unpacked=10_000))


def test_a_real_profiler_trace_of_a_training_loop_is_summarised() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    traces: list[str] = []
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=4, repeat=1)
    with torch.profiler.profile(schedule=schedule, on_trace_ready=lambda p: traces.append(_export(p))) as profiler:
        for _ in range(5):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step()
    summary = summarise_bytes(gzip.compress(traces[0].encode()))
    assert summary.device == "cpu" and summary.steps == 4
    assert summary.comm_s == 0 and summary.compute_s > 0
    assert summary.compute_s + summary.idle_s == pytest.approx(summary.step_time_s, rel=1e-6)


def _export(profiler: torch.profiler.profile) -> str:
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        profiler.export_chrome_trace(path)
        with open(path) as f:
            return f.read()
    finally:
        os.unlink(path)


spans = st.lists(
    st.tuples(st.integers(0, 1000), st.integers(0, 200)).map(lambda t: (float(t[0]), float(t[0] + t[1]))),
    max_size=30,
)


@given(a=spans, b=spans)
def test_span_algebra_agrees_with_counting_unit_cells(
    a: list[tuple[float, float]], b: list[tuple[float, float]]
) -> None:
    def cells(s: list[tuple[float, float]]) -> set[int]:
        return {i for start, end in s for i in range(int(start), int(end))}

    ua, ub = union(a), union(b)
    assert length(ua) == len(cells(a))
    assert length(intersect(ua, ub)) == len(cells(a) & cells(b))
    assert length(subtract(ua, ub)) == len(cells(a) - cells(b))
    assert all(s1[1] < s2[0] for s1, s2 in itertools.pairwise(ua))  # disjoint, sorted, not touching


@settings(max_examples=200)
@given(
    compute=spans,
    comm=spans,
    steps=st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 300)), min_size=1, max_size=4),
)
def test_the_parts_always_add_up_to_the_window(
    compute: list[tuple[float, float]], comm: list[tuple[float, float]], steps: list[tuple[int, int]]
) -> None:
    events = [op(f"ProfilerStep#{i}", s, d, cat="user_annotation") for i, (s, d) in enumerate(steps)]
    events += [op("aten::mm", s, e - s) for s, e in compute]
    events += [op("gloo:all_reduce", s, e - s, tid=GLOO) for s, e in comm]
    summary = summarise(events)
    window = summary.step_time_s
    assert summary.overlap_s <= min(summary.compute_s, summary.comm_s) + 1e-12
    busy = summary.compute_s + summary.comm_s - summary.overlap_s
    assert math.isclose(busy + summary.idle_s, window, rel_tol=1e-9, abs_tol=1e-12)
    assert summary.exposed_comm_s == pytest.approx(summary.comm_s - summary.overlap_s, abs=1e-12)
