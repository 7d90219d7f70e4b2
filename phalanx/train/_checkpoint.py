"""Checkpoints from inside the training loop.

Writing: the ranks that write (rank 0, or every rank when sharded) save under a temporary name
on the training thread (the same cost as a plain `torch.save`, into the page cache); a background
thread then flushes the files to the disk (local filesystems), renames the folder into place and
commits it to the server. A checkpoint exists for Phalanx only once that commit is recorded, so a
crash mid-write, or a machine's power loss after the commit, never leaves a corrupt "latest".

Reading: a new attempt gets its resume point from the agent (PHALANX_RESUME_STEP/_PATH);
`ctx.latest_checkpoint` exposes it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from phalanx import _wire

logger = logging.getLogger("phalanx.train")
STATE_FILE = "state.pt"
RANK_STATE_DIR = "phalanx-rank-state"  # each rank's own state that resumes with it (see CheckpointWriter)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its step and where its files are (an fsspec URI)."""

    step: int
    path: str

    @property
    def local_path(self) -> Path | None:
        """The folder on this machine, when the storage is a local (or shared) filesystem."""
        fs, root = fsspec.core.url_to_fs(self.path)
        return Path(root) if _is_local(fs) else None

    def load(self, name: str = STATE_FILE, **torch_load_kwargs: Any) -> Any:
        """torch.load one file of the checkpoint (the state dict `save_checkpoint` wrote by default)."""
        torch_load_kwargs.setdefault("map_location", "cpu")
        with fsspec.open(f"{self.path}/{name}", "rb") as handle:
            return torch.load(handle, **torch_load_kwargs)


def load_rank_state(checkpoint: Checkpoint, rank: int, world_size: int) -> Any:
    """What `rank` saved of its own in `checkpoint` (CheckpointWriter.rank_state), or None when it
    saved nothing or the gang had another size (the state then starts afresh)."""
    fs, root = fsspec.core.url_to_fs(f"{checkpoint.path}/{RANK_STATE_DIR}/rank-{rank}.pt")
    if not fs.exists(root):
        return None
    with fs.open(root, "rb") as handle:
        saved = torch.load(handle, map_location="cpu", weights_only=False)
    return saved["state"] if saved.get("world_size") == world_size else None


def _is_local(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "file" in protocols or "local" in protocols


def resume_point(env: Mapping[str, str]) -> Checkpoint | None:
    step, path = env.get("PHALANX_RESUME_STEP"), env.get("PHALANX_RESUME_PATH")
    if not step or not path:
        return None
    return Checkpoint(int(step), path)


@dataclass
class _Pending:
    step: int
    tmp: str
    final: str
    metrics: dict[str, float | str] = field(default_factory=dict)  # as the commit sends them


class CheckpointWriter:
    """Writes this rank's part, and (rank 0) commits in the background. One per process."""

    def __init__(
        self,
        root: str,
        attempt: int,
        rank: int,
        world_size: int,
        commit: Callable[[dict[str, Any]], bool] | None,
        on_superseded: Callable[[], None],
    ) -> None:
        self._root = root.rstrip("/")
        self._attempt = attempt
        self._rank = rank
        self._world_size = world_size
        self._commit = commit
        self._on_superseded = on_superseded
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self.committed: list[Checkpoint] = []
        # Each rank's own state that training needs back exactly (PowerSGD's error feedback),
        # written by every rank beside the checkpoint's files: `rank_state()` or None for none.
        self.rank_state: Callable[[], Any] | None = None
        self._saves_of_step: dict[int, int] = {}

    def save(
        self,
        state: Any,
        step: int,
        metrics: Mapping[str, Any] | None,
        sharded: bool,
        files: Collection[str] | None = None,
    ) -> None:
        pending = self._pending(step, metrics)
        if files is not None:
            sharded = True  # each rank's own files, into the one folder
        writes = sharded or self._rank == 0
        if writes:
            fs, tmp = fsspec.core.url_to_fs(pending.tmp)
            fs.makedirs(tmp, exist_ok=True)
            if isinstance(state, (str, os.PathLike)):
                source = Path(state)
                if not source.is_dir():
                    raise ValueError(f"checkpoint={state!r} is neither a state dict nor a folder")
                if files is not None:
                    _put_files(fs, source, files, tmp)
                else:
                    target = f"{tmp}/rank-{self._rank}" if sharded else tmp
                    fs.put(str(source), target, recursive=True)
            elif files is not None:
                raise ValueError("files= selects files of a folder; this checkpoint is a state dict")
            else:
                file_name = f"rank-{self._rank}.pt" if sharded else STATE_FILE
                if _is_local(fs):  # torch's own file writer: as fast as a plain torch.save
                    torch.save(state, os.path.join(tmp, file_name))
                else:
                    with fs.open(f"{tmp}/{file_name}", "wb") as handle:
                        torch.save(state, handle)
        wrote_rank_state = self._save_rank_state(pending.tmp)
        if (sharded or wrote_rank_state) and self._world_size > 1 and dist.is_initialized():
            dist.barrier()  # every rank's files are on disk before rank 0 renames the folder
        if self._rank == 0:
            self._start()
            self._idle.clear()
            self._queue.put(pending)

    def save_sharded(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: Mapping[str, Any],
        step: int,
        metrics: Mapping[str, Any] | None,
    ) -> None:
        """Every rank writes its shards through DCP, whose own collectives let rank 0 write the
        metadata last; rank 0 then renames and commits in the background as for any checkpoint."""
        from phalanx.train._sharding import save_sharded  # FSDP/DCP only for scripts that use them

        pending = self._pending(step, metrics)
        save_sharded(pending.tmp, model, optimizer, extra)
        if self._save_rank_state(pending.tmp) and self._world_size > 1 and dist.is_initialized():
            dist.barrier()
        if self._rank == 0:
            self._start()
            self._idle.clear()
            self._queue.put(pending)

    def _pending(self, step: int, metrics: Mapping[str, Any] | None) -> _Pending:
        """The folders of this save. A step saved again in one attempt (a framework's checkpoint
        and then the one written on a stop) writes to a temporary folder of its own: the first
        save's commit may be renaming its folder at that very moment. Ranks that save the same
        steps agree on the name; the newer commit replaces the older."""
        name = f"step-{step:012d}-a{self._attempt}"
        count = self._saves_of_step.get(step, 0) + 1
        self._saves_of_step = {step: count}  # steps only grow: older counts are never needed again
        tmp = f"{self._root}/{name}.tmp" if count == 1 else f"{self._root}/{name}.tmp{count}"
        return _Pending(step, tmp, f"{self._root}/{name}", _floats(metrics or {}))

    def _save_rank_state(self, tmp_url: str) -> bool:
        """Write `rank_state()` as RANK_STATE_DIR/rank-N.pt; False when there is none."""
        if self.rank_state is None:
            return False
        state = {"world_size": self._world_size, "state": self.rank_state()}
        fs, tmp = fsspec.core.url_to_fs(tmp_url)
        fs.makedirs(f"{tmp}/{RANK_STATE_DIR}", exist_ok=True)
        with fs.open(f"{tmp}/{RANK_STATE_DIR}/rank-{self._rank}.pt", "wb") as handle:
            torch.save(state, handle)
        return True

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="phalanx-checkpoints", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (pending := self._queue.get()) is not None:
            try:
                self._finish(pending)
            except Exception:  # a failed commit must not kill training; the previous one stays latest
                logger.exception("phalanx: checkpoint of step %d was not committed", pending.step)
            if self._queue.empty():
                self._idle.set()
        self._idle.set()

    def _finish(self, pending: _Pending) -> None:
        fs, tmp = fsspec.core.url_to_fs(pending.tmp)
        _, final = fsspec.core.url_to_fs(pending.final)
        if fs.exists(final):  # the same step saved twice in one attempt: the newer files win
            fs.rm(final, recursive=True)
        if _is_local(fs):
            # Durable before it becomes visible: a machine that loses power after the commit must
            # still hold the files. The training thread never waits for the disk (DCP's own fsync
            # is off); this thread does, once per checkpoint.
            _fsync_tree(Path(tmp))
            fs.mv(tmp, final, recursive=True)  # one rename on a filesystem: atomic
            _fsync(Path(final).parent)
        else:
            # Object stores have no folders to rename (a recursive mv trips over the folder's own
            # key on S3): move file by file. The checkpoint still becomes visible only when the
            # server records it, after the last file has moved.
            for source in fs.find(tmp):
                fs.mv(source, final + source[len(tmp) :])
            if fs.exists(tmp):  # filesystems with real folders keep the emptied one
                fs.rm(tmp, recursive=True)
        size = int(fs.du(final, total=True))
        checkpoint = Checkpoint(pending.step, pending.final)
        if self._commit is None:  # outside Phalanx: the folder is the record
            self.committed.append(checkpoint)
            return
        body = {"step": pending.step, "path": pending.final, "size_bytes": size, "metrics": pending.metrics}
        if self._commit(body):
            self.committed.append(checkpoint)
        else:
            self._on_superseded()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued checkpoint is committed (or failed); False on timeout."""
        return self._idle.wait(timeout)

    def close(self, timeout: float) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root` to the disk, then the folders that name them."""
    paths = sorted(root.rglob("*"), key=lambda path: path.is_dir())  # files first
    for path in [*paths, root]:
        _fsync(path)


def _fsync(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_files(fs: Any, source: Path, files: Collection[str], target: str) -> None:
    """Copy the named files (paths relative to `source`, which they may not leave) to `target`."""
    root = source.resolve()
    for name in files:
        path = (root / name).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise ValueError(f"checkpoint file {name!r} is not a file inside {source}")
        relative = path.relative_to(root).as_posix()
        if "/" in relative:
            fs.makedirs(f"{target}/{relative.rsplit('/', 1)[0]}", exist_ok=True)
        fs.put_file(str(path), f"{target}/{relative}")


def _floats(values: Mapping[str, Any]) -> dict[str, float | str]:
    """The numbers among `values`, a NaN or an infinity as its wire string (the server keeps it,
    and never ranks such a checkpoint best)."""
    out: dict[str, float | str] = {}
    for key, value in values.items():
        try:
            number = float(value.item() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        out[key] = _wire.encode(number)
    return out
