"""Communication: DDP built from the job's `ddp` options (DDP's own arguments, a compression hook),
and the always-on figures of where each rank's step time goes.

The figures cost the training loop two Python hooks (a counter on each forward, a clock read on
each optimizer step) and, twice a second at most, a read of DDP's own sampled timings
(`_get_ddp_logging_data`: DDP times one iteration in `SAMPLE_RATE` with its CPU or CUDA timer,
without synchronising the others). Every `REPORT_PERIOD_S` each rank reports, under the reserved
`phalanx/` prefix, per optimizer step: its step time, the time it waited for data (loaders from
`ctx.prepare_data_loader`), forward + backward compute, the all-reduce time not hidden behind the
backward pass ("exposed"), all of it, and the bytes it all-reduced. The server turns the ranks'
latest values into the job's `communication` (comm fraction, straggler ratio, slowest rank).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from phalanx.figures import COMM_BYTES, COMM_EXPOSED, COMM_TIME, COMPUTE_TIME, DATA_TIME, STEP_TIME
from phalanx.train._data import data_wait

REPORT_PERIOD_S = 5.0  # one record per rank per period: a few points a minute, whatever the step rate
FIRST_REPORT_S = 2.0  # the first comes sooner: the job page shows figures seconds after the start
READ_PERIOD_S = 0.5  # how often DDP's latest sample is read (each read builds a dict of ~30 entries)
SAMPLE_RATE = 20  # DDP times one iteration in this many (its default, 100, leaves slow jobs unsampled)
NS = 1e-9


def ddp_arguments(options: Mapping[str, Any], explicit: Mapping[str, Any]) -> dict[str, Any]:
    """DDP's keyword arguments: the job's options that differ from DDP's defaults, under what the
    script passed to `prepare_model` itself."""
    arguments: dict[str, Any] = {}
    if options.get("bucket_cap_mb") is not None:
        arguments["bucket_cap_mb"] = options["bucket_cap_mb"]
    for name in ("gradient_as_bucket_view", "static_graph"):
        if options.get(name):
            arguments[name] = True
    arguments.update(explicit)
    return arguments


def register_comm_hook(model: DistributedDataParallel, options: Mapping[str, Any]) -> PowerSGD | None:
    """Register the job's compression hook; returns PowerSGD's hook and state (checkpointed with
    the job, restored on resume) or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook = options.get("comm_hook", "none")
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        if dist.get_backend() == "nccl":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        else:  # torch's own refuses anything but NCCL; gloo all-reduces bfloat16 as well
            model.register_comm_hook(None, bfloat16_allreduce_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(options.get("powersgd_rank", 1)),
            start_powerSGD_iter=int(options.get("powersgd_start_iter", 10)),
            random_seed=0,  # every rank draws the same projections, every attempt the same ones
        )
        powersgd = PowerSGD(model, state, serialise=dist.get_backend() != "nccl")
        model.register_comm_hook(state, powersgd.hook)
        return powersgd
    elif hook != "none":
        raise ValueError(f"comm_hook={hook!r}: use none, fp16, bf16 or powersgd")
    return None


def bfloat16_allreduce_hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` for any backend (DDP refuses that name off NCCL): the bucket
    all-reduced as bfloat16 (half the bytes), divided by the world size first, and written back
    in the gradients' dtype."""
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    compressed = bucket.buffer().to(torch.bfloat16).div_(world_size)
    work: Any = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer: torch.Tensor = bucket.buffer()
        buffer.copy_(done.value()[0])
        return buffer

    result: torch.futures.Future[torch.Tensor] = work.get_future().then(decompress)
    return result


class PowerSGD:
    """torch's PowerSGD hook and state, kept exact across a restart.

    PowerSGD keys its error feedback and its P and Q factors by bucket, laid out in the bucket's
    parameter order. DDP lays buckets out once in parameter order and again, after the first
    iteration, in the order gradients became ready: a resumed attempt's first iteration meets
    the saved state in the other layout (measured: the digest of the resumed run differed). So
    each bucket's layout is recorded with the state, and when a bucket arrives in another one
    the state is cut into its parameters' pieces and reassembled in the bucket's order.

    On gloo, which matches collectives by the order each rank issues them, two buckets' chains
    of all-reduces interleave differently on two ranks (measured: a size mismatch, then an
    abort): there each bucket waits for the previous one's future. NCCL orders them on its stream.
    """

    def __init__(self, model: nn.Module, state: Any, serialise: bool) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.state = state
        self._hook = powerSGD_hook.powerSGD_hook
        self._serialise = serialise
        self._index = {id(p): i for i, p in enumerate(model.parameters())}
        self._shapes = [tuple(p.shape) for p in model.parameters()]
        self.layout: dict[int, list[int]] = {}  # bucket index -> its parameters' indices, in order
        self._pieces: dict[int, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] = {}
        self._previous: Any = None

    def hook(self, state: Any, bucket: Any) -> Any:
        order = [self._index[id(p)] for p in bucket.parameters()]
        index = bucket.index()
        if self.layout.get(index, order) != order or self._pieces:
            self._relayout(index, order)
        self.layout[index] = order
        if self._serialise and self._previous is not None and not self._previous.done():
            self._previous.wait()
        future = self._hook(state, bucket)
        self._previous = future
        return future

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state.__getstate__(), "layout": dict(self.layout)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.__setstate__(saved["state"])
        self.layout = {int(k): list(v) for k, v in saved["layout"].items()}

    def _rank_of(self, param: int) -> tuple[bool, int, int, int]:
        """(compressed?, n, m, r) for a parameter, PowerSGD's own rule (`_should_compress`)."""
        shape = self._shapes[param]
        n = shape[0] if shape else 1
        numel = math.prod(shape)
        m = numel // n if n else 0
        r = min(n, m, self.state.matrix_approximation_rank)
        return numel > (n + m) * r * self.state.min_compression_rate, n, m, r

    def _relayout(self, index: int, order: list[int]) -> None:
        """Cut every bucket the state holds in its recorded layout into per-parameter pieces (once),
        then give bucket `index` its pieces in `order`."""
        state = self.state
        for old_index, old_order in list(self.layout.items()):
            if old_index not in state.error_dict and old_index not in state.p_memory_dict:
                continue
            error = state.error_dict.pop(old_index, None)
            ps, qs = state.p_memory_dict.pop(old_index, None), state.q_memory_dict.pop(old_index, None)
            e_at = p_at = q_at = 0
            for param in old_order:
                compressed, n, m, r = self._rank_of(param)
                numel = math.prod(self._shapes[param])
                piece_e = None if error is None else error[e_at : e_at + numel]
                piece_p = piece_q = None
                if compressed and ps is not None and qs is not None:
                    piece_p, piece_q = ps[p_at : p_at + n * r], qs[q_at : q_at + m * r]
                    p_at, q_at = p_at + n * r, q_at + m * r
                e_at += numel
                self._pieces[param] = (piece_e, piece_p, piece_q)
            del self.layout[old_index]
        if not all(param in self._pieces for param in order):
            return
        pieces = [self._pieces.pop(param) for param in order]
        if all(e is not None for e, _, _ in pieces):
            state.error_dict[index] = torch.cat([e for e, _, _ in pieces if e is not None])
        ps_list = [p for _, p, _ in pieces if p is not None]
        qs_list = [q for _, _, q in pieces if q is not None]
        if ps_list:
            state.p_memory_dict[index] = torch.cat(ps_list)
            state.q_memory_dict[index] = torch.cat(qs_list)


# DDP checks a hook's annotations when it is registered: the classes themselves, not the strings
# that postponed annotations leave.
PowerSGD.hook.__annotations__.update(
    bucket=dist.GradBucket,  # type: ignore[attr-defined]
    **{"return": torch.futures.Future[torch.Tensor]},
)
bfloat16_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket,  # type: ignore[attr-defined]
    process_group=object,
    **{"return": torch.futures.Future[torch.Tensor]},
)


class CommMonitor:
    """Times one DDP model's steps on this rank and reports them every REPORT_PERIOD_S."""

    def __init__(
        self,
        model: DistributedDataParallel,
        report: Callable[[dict[str, float]], None],
        comm_hook: str = "none",
        powersgd: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._model = model
        self._report = report
        self._comm_hook = comm_hook
        self._powersgd = powersgd
        self._clock = clock
        self._grad_bytes = next((p.element_size() for p in model.parameters() if p.requires_grad), 4)
        self._bucket_bytes = 0  # DDP's buckets, summed: what one all-reduce of every gradient moves
        self._powersgd_mark = self._powersgd_counts()
        if model.device_type == "cpu":  # a CUDA sample synchronises its events: keep DDP's own rate there
            model._set_ddp_runtime_logging_sample_rate(SAMPLE_RATE)  # type: ignore[no-untyped-call]
        self._forwards = 0
        self._steps = 0
        self._reported = False
        self._window_start = clock()
        self._last_read = self._window_start
        self._data_wait_start = data_wait.seconds
        self._seen_iteration = -1
        self._samples: list[tuple[float, float, float]] = []  # (compute, comm, exposed) per sampled iteration
        self._forward_handle = model.register_forward_pre_hook(self._on_forward)
        self._step_handle = register_optimizer_step_post_hook(self._on_step)

    def close(self) -> None:
        self._forward_handle.remove()
        self._step_handle.remove()

    def _on_forward(self, _module: nn.Module, _inputs: Any) -> None:
        self._forwards += 1

    def _on_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._steps += 1
        now = self._clock()
        if now - self._last_read >= READ_PERIOD_S:
            self._last_read = now
            self._read_sample()
            period = REPORT_PERIOD_S if self._reported else min(FIRST_REPORT_S, REPORT_PERIOD_S)
            if now - self._window_start >= period:
                self._emit(now)

    def _read_sample(self) -> None:
        data: dict[str, Any] = self._model._get_ddp_logging_data()  # type: ignore[no-untyped-call]
        iteration = int(data.get("iteration", -1))
        comm = int(data.get("backward_comm_time", 0))
        if iteration == self._seen_iteration or comm <= 0:
            return  # no new sample, or one without an all-reduce (a no_sync micro-batch)
        self._seen_iteration = iteration
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
        self._bucket_bytes = sum(int(size) for size in sizes.split(",") if size.strip().isdigit())
        compute = int(data.get("forward_compute_time", 0)) + int(data.get("backward_compute_time", 0))
        overlap = int(data.get("backward_compute_comm_overlap_time", 0))
        self._samples.append((compute * NS, comm * NS, max(comm - overlap, 0) * NS))

    def _emit(self, now: float) -> None:
        steps, forwards = self._steps, self._forwards
        if steps == 0 or not self._samples:
            return
        step_time = (now - self._window_start) / steps
        waited = data_wait.seconds - self._data_wait_start
        compute = statistics.fmean(s[0] for s in self._samples)
        comm = statistics.fmean(s[1] for s in self._samples)
        exposed = statistics.fmean(s[2] for s in self._samples)
        micro_batches = max(forwards / steps, 1.0)  # gradient accumulation: one all-reduce per step
        compute *= micro_batches
        # The sampled iterations may run slower than the window's average step (a busy moment,
        # the sample's own timers): the parts of a step never add up to more than the step.
        room = max(step_time - waited / steps, 0.0)
        if compute + exposed > room > 0:
            scale = room / (compute + exposed)
            compute, exposed = compute * scale, exposed * scale
        self._report(
            {
                STEP_TIME: step_time,
                DATA_TIME: waited / steps,
                COMPUTE_TIME: compute,
                COMM_EXPOSED: exposed,
                COMM_TIME: comm,
                COMM_BYTES: self._bytes_per_step(steps),
            }
        )
        self._window_start, self._steps, self._forwards = now, 0, 0
        self._reported = True
        self._data_wait_start = data_wait.seconds
        self._samples = []
        self._powersgd_mark = self._powersgd_counts()

    def _bytes_per_step(self, steps: int) -> float:
        """What this rank all-reduced per step over the window: DDP's bucket bytes, half of them
        under fp16/bf16, and under PowerSGD what its state counted it sent (the P and Q factors,
        and the tensors it leaves uncompressed), with its warm-up steps at full size."""
        if self._comm_hook in ("fp16", "bf16"):
            return self._bucket_bytes * 2 / self._grad_bytes
        if self._comm_hook != "powersgd":
            return float(self._bucket_bytes)
        iteration, numel = self._powersgd_counts()
        start_iteration, start_numel = self._powersgd_mark
        warm_up = max(0, min(int(self._powersgd.start_powerSGD_iter), iteration) - start_iteration)
        return ((numel - start_numel) * self._grad_bytes + warm_up * self._bucket_bytes) / steps

    def _powersgd_counts(self) -> tuple[int, int]:
        if self._powersgd is None:
            return 0, 0
        return int(self._powersgd.iter), int(self._powersgd.total_numel_after_compression)
