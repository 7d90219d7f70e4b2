"""`init()` and the `Context` a training script works through."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from phalanx.figures import PREFIX as RESERVED_METRIC_PREFIX
from phalanx.train._checkpoint import STATE_FILE, Checkpoint, CheckpointWriter, load_rank_state, resume_point
from phalanx.train._comm import CommMonitor, PowerSGD, ddp_arguments, register_comm_hook
from phalanx.train._data import PreparedDataLoader, prepare_data_loader
from phalanx.train._env import RuntimeEnv, read_env
from phalanx.train._metrics import MetricPipeline, MetricRecordDict, MetricSink, MetricStats
from phalanx.train._profile import OnDemandProfiler
from phalanx.train._teardown import wait_for_idle_gloo_workers

DEFAULT_FINISH_TIMEOUT_S = 10.0
GLOO_IDLE_TIMEOUT_S = 2.0
# should_stop() shares the ranks' stop flags about this often (a round costs a small all_reduce,
# ~0.3 ms of CPU on gloo here: every step would cost a fast step ~20 %), in at most this many calls.
STOP_CHECK_PERIOD_S = 0.1
MAX_STOP_CHECK_CALLS = 10_000

_current: Context | None = None
_current_lock = threading.Lock()


def init() -> Context:
    """Set up this process from its environment; a second call returns the same live context."""
    global _current
    with _current_lock:
        if _current is None or _current.finished:
            _current = Context(read_env())
        return _current


def _report_after_finish(_item: Any) -> None:
    raise RuntimeError("ctx.report() was called after ctx.finish()")


class Context:
    """Everything a rank needs: who it is, where it runs, and the job's settings.

    Built by `init()`; use one per process.
    """

    def __init__(self, env: RuntimeEnv) -> None:
        self.rank = env.rank
        self.local_rank = env.local_rank
        self.world_size = env.world_size
        self.hparams: dict[str, Any] = dict(env.hparams)
        self.precision = env.precision
        # The job's `ddp` options (comm_hook, bucket_cap_mb, ...): what prepare_model builds DDP with.
        self.ddp_options: dict[str, Any] = dict(env.ddp)
        self._comm_monitor: CommMonitor | None = None
        self.comm_state: PowerSGD | None = None  # PowerSGD's hook and state, checkpointed per rank
        self.job_id = env.job_id
        self.allocation_id = env.allocation_id
        self.attempt = env.attempt
        # The committed checkpoint this attempt starts from (None on a first attempt).
        self.latest_checkpoint: Checkpoint | None = resume_point(os.environ)
        self.finished = False

        if torch.cuda.is_available():
            self.device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

        self.grad_scaler: torch.amp.GradScaler | None = None
        if self.precision == "fp16-mixed":
            # float16 overflows without loss scaling; bf16 has fp32's range and needs none.
            self.grad_scaler = torch.amp.GradScaler(self.device.type)

        self._owns_process_group = False
        if self.world_size > 1:
            self._init_process_group(env)

        sink: MetricSink | None = None
        committer: Callable[[dict[str, Any]], bool] | None = None
        # `phalanx jobs profile`: the server's requests arrive in the answers to metric batches
        self._profiler: OnDemandProfiler | None = None
        if env.managed:
            # the HTTP stack only with a server
            from phalanx.train._http import HttpMetricSink, http_committer, http_profile_sender

            assert env.url is not None and env.allocation_id is not None  # read_env checked
            self._profiler = OnDemandProfiler(
                http_profile_sender(env.url, env.allocation_id, env.token, self.rank), self.device.type
            )
            sink = HttpMetricSink(env.url, env.allocation_id, env.token, on_profile=self._profiler.ask)
            committer = http_committer(env.url, env.allocation_id, env.token)
        self._pipeline = MetricPipeline(self.rank, sink)
        self._checkpoint_superseded = False
        # Outside Phalanx (plain python/torchrun) checkpoints go to a fresh temporary folder unless
        # PHALANX_CHECKPOINT_ROOT says where: never into the code folder, which Phalanx uploads.
        root = os.environ.get("PHALANX_CHECKPOINT_ROOT") or f"file://{tempfile.mkdtemp(prefix='phalanx-checkpoints-')}"
        self._checkpoints = CheckpointWriter(
            root, env.attempt, self.rank, self.world_size, committer, self._superseded_by_checkpoint
        )
        # Bound once: report() then costs a method call, a dict copy and a queue put.
        self._put: Callable[[Any], None] = self._pipeline.queue.put
        # report() without a step counts on from here: after a resume, from the checkpoint's step
        self._last_step: Any = -1 if self.latest_checkpoint is None else self.latest_checkpoint.step

        self._sigterm_received = False
        self._stop_agreed = False
        self._stop_group: Any = None
        self._stop_round: tuple[torch.Tensor, Any] | None = None  # the flag all-reduce under way
        self._stop_calls = 0  # calls of should_stop() so far
        self._stop_next_round = 1  # the call that reads the round under way and starts the next
        self._stop_round_started = time.monotonic()
        self._stop_round_call = 0
        self._previous_sigterm: Any = None
        self._sigterm_installed = False
        if threading.current_thread() is threading.main_thread():
            # Preemption and cancellation arrive as SIGTERM (SIGKILL follows after a grace
            # period): turn it into should_stop() so the loop can checkpoint and leave cleanly.
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True

        atexit.register(self.finish)

    def _init_process_group(self, env: RuntimeEnv) -> None:
        if dist.is_initialized():  # the script set it up itself; leave it to the script
            if dist.get_world_size() != self.world_size:
                raise RuntimeError(
                    f"an existing process group has {dist.get_world_size()} ranks, WORLD_SIZE says {self.world_size}"
                )
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # A hung peer blocks every collective until this timeout; torch's default is 30 minutes.
        timeout = timedelta(seconds=env.pg_timeout_s)
        if self.device.type == "cuda":
            dist.init_process_group(backend=backend, timeout=timeout, device_id=self.device)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
        self._owns_process_group = True

    def take_back_sigterm(self) -> None:
        """Make SIGTERM this context's again, where a framework installed a handler of its own
        (Lightning's ends `fit` with an exception, without a checkpoint): a stop then reaches
        `should_stop()`. Main thread only, as signal handlers are."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._sigterm_received = True
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)

    # --- model, data, precision ---------------------------------------------------------

    def prepare_model(
        self,
        model: torch.nn.Module,
        strategy: str = "ddp",
        *,
        fsdp_units: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None,
        **ddp_kwargs: Any,
    ) -> torch.nn.Module:
        """Move the model to this rank's device and spread it over the ranks.

        strategy "ddp": DistributedDataParallel when there are peers (`ddp_kwargs` go to it).
        strategy "fsdp": FSDP2 (`fully_shard`) over `fsdp_units(model)` (default: each member of
        every nn.ModuleList, a transformer's blocks), then the whole model; parameters, gradients
        and optimizer state are sharded across the ranks, and the job's bf16/fp16 precision is
        FSDP's mixed precision. Save it with `save_sharded_checkpoint`.
        """
        if strategy not in ("ddp", "fsdp"):
            raise ValueError(f"strategy={strategy!r}: use 'ddp' or 'fsdp'")
        model = model.to(self.device)
        if strategy == "fsdp":
            if ddp_kwargs:
                raise ValueError(f"{', '.join(ddp_kwargs)}: DDP arguments, and the strategy is 'fsdp'")
            if not dist.is_initialized():
                # FSDP needs a process group, even of one rank (plain `python train.py`)
                self._init_single_process_group()
            from phalanx.train._sharding import shard_model

            model = shard_model(model, self.precision, fsdp_units)
        elif self.world_size > 1:
            model = self._wrap_ddp(model, ddp_kwargs)
        _freeze_setup_if_forked()
        return model

    def _wrap_ddp(self, model: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> DistributedDataParallel:
        """DDP with the job's options and compression hook, its hook state restored from the
        checkpoint this attempt resumes, and its step times measured (see `_comm.py`)."""
        arguments = ddp_arguments(self.ddp_options, ddp_kwargs)
        if self.device.type == "cuda":
            arguments.setdefault("device_ids", [self.device.index])
        ddp = DistributedDataParallel(model, **arguments)
        if self._comm_monitor is not None:
            self._comm_monitor.close()  # a second model: the figures follow the latest
            self._comm_monitor = None
        self.comm_state = register_comm_hook(ddp, self.ddp_options)
        if self.comm_state is not None:
            if self.latest_checkpoint is not None:
                saved = load_rank_state(self.latest_checkpoint, self.rank, self.world_size)
                if saved is not None:
                    self.comm_state.load_state_dict(saved)
            self._checkpoints.rank_state = self._comm_state_to_save
        if self.ddp_options.get("timing", True):
            powersgd = None if self.comm_state is None else self.comm_state.state
            self._comm_monitor = CommMonitor(ddp, self._report_reserved, self.ddp_options["comm_hook"], powersgd)
        return ddp

    def _comm_state_to_save(self) -> Any:
        assert self.comm_state is not None  # set before this is handed to the checkpoint writer
        return self.comm_state.state_dict()

    def _report_reserved(self, values: dict[str, float]) -> None:
        """Platform figures (the `phalanx/` prefix), at the script's latest step."""
        self._put((max(int(self._last_step), 0), time.time(), values))

    def _init_single_process_group(self) -> None:
        store = dist.HashStore()  # type: ignore[attr-defined]  # torch leaves it out of __all__
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
        self._owns_process_group = True

    def prepare_data_loader(self, loader: DataLoader[Any], *, move_to_device: bool = True) -> PreparedDataLoader:
        """Give each rank its own shard (DistributedSampler, shuffled like `loader`), epoch-aware.

        Each iteration of the returned loader is one epoch: `set_epoch` is called for you. With
        one process the loader's own sampler is kept. Batches are moved to `device` (not on CPU).
        """
        return prepare_data_loader(
            loader,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            move_to_device=move_to_device,
        )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """torch's AMP for the job's precision; a no-op for "32"."""
        if self.precision == "bf16-mixed":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        if self.precision == "fp16-mixed":
            return torch.autocast(device_type=self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Backward pass and optimizer step (loss-scaled for fp16-mixed), then zero the gradients."""
        if self.grad_scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            optimizer.step()
        else:
            self.grad_scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            self.grad_scaler.step(optimizer)
            self.grad_scaler.update()
        optimizer.zero_grad(set_to_none=True)

    # --- metrics and control -------------------------------------------------------------

    def report(
        self, values: Mapping[str, Any], step: int | None = None, *, checkpoint: Any = None, sharded: bool = False
    ) -> None:
        """Record metrics for `step` (default: the previous step + 1). Never blocks.

        Values may be numbers or 0-dim tensors; tensors are read later by a background thread,
        so do not modify a reported tensor in place afterwards. nan/inf values are dropped.
        With `checkpoint=` (a state dict, or a folder the script wrote) the checkpoint of this
        step is saved too, and these metrics rank it for retention (see `save_checkpoint`).
        """
        if step is None:
            step = self._last_step + 1
        for name in values:
            if name.startswith(RESERVED_METRIC_PREFIX):
                raise ValueError(
                    f"metric {name!r}: names under {RESERVED_METRIC_PREFIX!r} are Phalanx's own; rename it"
                )
        self._last_step = step
        # The copy protects against the caller reusing its dict; everything else is deferred.
        self._put((step, time.time(), dict(values)))
        if checkpoint is not None:
            self.save_checkpoint(checkpoint, step=step, metrics=values, sharded=sharded)

    def save_checkpoint(
        self,
        state: Any,
        step: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        *,
        sharded: bool = False,
        files: Collection[str] | None = None,
    ) -> None:
        """Save a checkpoint of `step` (default: the last step reported): a state dict (saved with
        torch.save) or a folder's files. A resumed attempt's `report()` steps count on from it.

        Call it on every rank. Rank 0 writes unless `sharded`, where each rank writes its part
        (a state dict as `rank-N.pt`, a folder as `rank-N/`), and all ranks meet at a barrier.
        With a folder and `files` (paths relative to it), each rank writes just those files and
        they all land in the checkpoint's one folder: for frameworks whose ranks write into a
        shared folder (no two ranks may name the same file). The training thread pays for writing
        the files only; the rename into place and the commit to Phalanx happen in the background.
        """
        if step is None:
            step = max(int(self._last_step), 0)
        self._checkpoints.save(state, step, metrics, sharded, files)

    def load_checkpoint(self, name: str = STATE_FILE, **torch_load_kwargs: Any) -> Any:
        """What the latest committed checkpoint holds (the state dict `save_checkpoint` wrote), on
        CPU; None when there is none (a first attempt, or outside Phalanx)."""
        latest = self.latest_checkpoint
        return None if latest is None else latest.load(name, **torch_load_kwargs)

    def save_sharded_checkpoint(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Any] | None = None,
        step: int | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        """Save the model, the optimizer and `extra` (anything torch.save can pickle) as a sharded
        checkpoint of `step` (default: the last step reported) through torch.distributed.checkpoint:
        every rank writes its own shards, and the checkpoint is committed once. For FSDP models
        (no rank ever holds the whole state); DDP and single-process models work the same way.

        Call it on every rank. The checkpoint root must be shared by the nodes (a shared
        filesystem or an object store), as for `sharded=True`."""
        if step is None:
            step = max(int(self._last_step), 0)
        self._checkpoints.save_sharded(model, optimizer, extra or {}, step, metrics)

    def load_sharded_checkpoint(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any] | None:
        """Load the latest checkpoint that `save_sharded_checkpoint` wrote into `model` (and
        `optimizer`) in place, resharded for this world size; return its `extra`, or None when
        there is no checkpoint yet. Call it on every rank, after `prepare_model`."""
        latest = self.latest_checkpoint
        if latest is None:
            return None
        from phalanx.train._sharding import load_sharded

        return load_sharded(latest.path, model, optimizer)

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU on rank 0 (gathered from the shards under FSDP; the
        other ranks take part and get an empty dict): to export the trained model."""
        from phalanx.train._sharding import full_model_state

        return full_model_state(model)

    def _superseded_by_checkpoint(self) -> None:
        self._checkpoint_superseded = True

    def stop_requested(self) -> bool:
        """True once this process was asked to leave: SIGTERM, or a newer attempt superseded it.
        This rank's own view, at no cost; `should_stop()` is the one every rank agrees on."""
        return self._sigterm_received or self._pipeline.superseded or self._checkpoint_superseded

    def should_stop(self) -> bool:
        """Whether to leave now, the same answer on every rank at the same call: call it on every
        rank once per step (or epoch), and it turns true on all of them together once any rank was
        asked to stop (SIGTERM from a pause, drain, preemption or pruning; a superseded attempt).

        It never waits for the other ranks. Every few calls (about every STOP_CHECK_PERIOD_S) it
        starts an all_reduce of this rank's flag on a small gloo group of its own, and reads it as
        many calls later, long finished by then; the reduction also agrees on how many calls that
        is, so every rank reads the same round at the same call. A stop is seen within about twice
        that period."""
        if self._stop_agreed:
            return True
        if self.world_size == 1 or not dist.is_initialized():
            self._stop_agreed = self.stop_requested()
            return self._stop_agreed
        self._stop_calls += 1
        if self._stop_calls < self._stop_next_round:
            return False
        interval = 1
        if self._stop_round is not None:
            values, work = self._stop_round
            work.wait()
            self._stop_round = None
            if values[0].item() > 0:
                self._stop_agreed = True
                return True
            interval = int(values[1].item())
        self._start_stop_round(interval)
        return False

    def _start_stop_round(self, interval: int) -> None:
        """Share this rank's flag and its proposal for the next round's distance in calls (one
        STOP_CHECK_PERIOD_S at its own pace); both are reduced by MAX."""
        now = time.monotonic()
        per_call = (now - self._stop_round_started) / max(self._stop_calls - self._stop_round_call, 1)
        self._stop_round_started, self._stop_round_call = now, self._stop_calls
        proposal = max(1, min(MAX_STOP_CHECK_CALLS, int(STOP_CHECK_PERIOD_S / max(per_call, 1e-9))))
        if self._stop_group is None:
            # Its own group: the flag's all_reduce never queues behind (or between) DDP's buckets,
            # and it runs on CPU whatever the training backend is.
            self._stop_group = dist.new_group(backend="gloo")
        values = torch.tensor([1 if self.stop_requested() else 0, proposal], dtype=torch.int64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._stop_group, async_op=True)
        assert work is not None  # async_op=True always returns the work
        self._stop_round = (values, work)
        self._stop_next_round = self._stop_calls + interval

    def flush(self, timeout: float = DEFAULT_FINISH_TIMEOUT_S) -> bool:
        """Wait until every metric reported so far was sent (or stored); False on timeout."""
        return self._pipeline.flush(timeout)

    @property
    def metrics(self) -> list[MetricRecordDict]:
        """Records kept in memory when running outside Phalanx (empty when they go to a server)."""
        return self._pipeline.records

    def metric_stats(self) -> MetricStats:
        return self._pipeline.stats()

    def finish(self, timeout: float = DEFAULT_FINISH_TIMEOUT_S) -> None:
        """Flush metrics (waiting at most `timeout` s) and tear down the process group. Idempotent."""
        global _current
        if self.finished:
            return
        self.finished = True
        self._put = _report_after_finish
        if self._comm_monitor is not None:
            self._comm_monitor.close()
            self._comm_monitor = None
        if self._profiler is not None:
            self._profiler.close(timeout)
            self._profiler = None
        # The last checkpoint (often the one written because should_stop() said so) must commit.
        self._checkpoints.flush(timeout)
        self._checkpoints.close(1.0)
        self._pipeline.close(timeout)
        if self._stop_round is not None:
            # Every rank started this round (same number of calls), so it completes; a peer that
            # died fails it instead, which changes nothing here.
            with contextlib.suppress(RuntimeError):
                self._stop_round[1].wait()
            self._stop_round = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        if self.world_size > 1:
            # Before the interpreter finalizes: see _teardown for the abort this avoids.
            wait_for_idle_gloo_workers(min(timeout, GLOO_IDLE_TIMEOUT_S))
        if (
            self._sigterm_installed
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == self._on_sigterm
        ):
            # None: the previous handler was not installed from Python; the default is the best guess.
            previous = signal.SIG_DFL if self._previous_sigterm is None else self._previous_sigterm
            signal.signal(signal.SIGTERM, previous)
        atexit.unregister(self.finish)
        with _current_lock:
            if _current is self:
                _current = None


def _freeze_setup_if_forked() -> None:
    """In a rank forked from Phalanx's fork-server, move what the setup built out of the garbage
    collector's reach before training starts.

    The fork-server froze torch's modules before forking (see worker_agent/forkserver.py), so the
    collector no longer counts them as its old generation. Python runs a full collection once the
    objects that survived since the last one reach a quarter of that old generation: a forked
    rank's old generation is only what it built itself, and the setup's own leftovers (a first
    checkpoint's planner, say) then set off full collections in the first training steps, each
    traversing every object the script imported (~45 ms measured, in an FSDP job's first
    checkpoint). Collected and frozen here, those objects are never traversed again, and the
    collections that follow walk only what training creates. A fresh interpreter counts its
    imports in the old generation and needs none of this."""
    if gc.get_freeze_count() == 0:
        return
    gc.collect()
    gc.freeze()
