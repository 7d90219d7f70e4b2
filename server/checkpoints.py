"""The checkpoint registry: commit, what a new attempt resumes from, retention.

Contract: a row exists only for a checkpoint whose files are complete (workers write under a
temporary name and rename before they commit). Retention marks rows DELETING after the newer
checkpoint committed; `delete_marked` removes a row only after its files are gone.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from phalanx.schemas import CheckpointCommit, CheckpointPolicy, JobSpec
from server.errors import Conflict, Unprocessable
from server.models import Allocation, Checkpoint, Job, Metric
from server.settings import Settings
from server.task_names import DELETE_CHECKPOINTS_TASK
from server.transitions import COMMITTED, DELETING, transition_checkpoint
from server.wakeups import note_job_data, note_task

log = logging.getLogger(__name__)


def normalised(uri: str) -> str | None:
    """`uri` with `.` and `..` resolved and no trailing slash, so that a prefix test means
    "inside"; None for what names no plain location (no protocol, a query or a fragment)."""
    parts = urlsplit(uri)
    if not parts.scheme or parts.query or parts.fragment:
        return None
    path = posixpath.normpath("/" + parts.path.lstrip("/")) if parts.path else "/"
    return urlunsplit((parts.scheme.lower(), parts.netloc, path.rstrip("/") or "/", "", ""))


def within(uri: str, root: str) -> bool:
    """`uri` is `root` or inside it, once both are normalised."""
    inner, outer = normalised(uri), normalised(root)
    return inner is not None and outer is not None and (inner == outer or inner.startswith(outer.rstrip("/") + "/"))


def check_storage(storage: str | None, settings: Settings, field: str = "checkpoint.storage") -> None:
    """Refuse (422) a job's checkpoint storage outside the roots the cluster allows: a server that
    reads, archives and deletes checkpoints must never be pointed at /etc or at an http:// URL."""
    if storage is None or any(within(storage, root) for root in settings.allowed_checkpoint_roots):
        return
    roots = ", ".join(settings.allowed_checkpoint_roots)
    raise Unprocessable(
        f"{field}: {storage!r} is outside the checkpoint roots this cluster allows ({roots}); "
        "name one of them or a path under it, or leave it out for the default"
    )


def job_root(storage: str, job_id: int) -> str:
    return f"{storage.rstrip('/')}/job-{job_id}"


def storage_for(spec: JobSpec, job_id: int, default_uri: str) -> str:
    """Where the job's checkpoints live: its spec's storage, else the cluster's default."""
    return job_root(spec.checkpoint.storage or default_uri, job_id)


def latest_checkpoint(session: Session, job_id: int) -> Checkpoint | None:
    return session.scalars(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.state == COMMITTED)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
    ).first()


def committed(session: Session, job_id: int) -> list[Checkpoint]:
    """The job's checkpoints whose files are complete, oldest step first."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.state == COMMITTED)
    return list(session.scalars(query.order_by(Checkpoint.step)))


def supersede_redone_steps(session: Session, job_id: int, new_allocation_id: int, resume_step: int | None) -> None:
    """The new attempt re-does every step after its resume point: mark older points for them."""
    query = update(Metric).where(
        Metric.job_id == job_id, Metric.allocation_id != new_allocation_id, Metric.superseded.is_(False)
    )
    if resume_step is not None:
        query = query.where(Metric.step > resume_step)
    session.execute(query.values(superseded=True))


def to_keep(checkpoints: list[Checkpoint], policy: CheckpointPolicy) -> set[int]:
    """Ids of the checkpoints retention keeps: the newest `keep_last`, plus the best `keep_best`
    by `policy.metric` among those that reported it as a finite number (a NaN or infinite loss is
    no one's best). Pure."""
    newest = sorted(checkpoints, key=lambda c: (c.step, c.id), reverse=True)[: policy.keep_last]
    keep = {c.id for c in newest}
    metric = policy.metric
    if policy.keep_best and metric:
        ranked = [c for c in checkpoints if metric in c.metrics and math.isfinite(c.metrics[metric])]
        ranked.sort(key=lambda c: (c.metrics[metric], -c.step), reverse=policy.mode == "max")
        keep |= {c.id for c in ranked[: policy.keep_best]}
    return keep


def commit(session: Session, allocation: Allocation, job: Job, body: CheckpointCommit, default_uri: str) -> Checkpoint:
    """Record a checkpoint whose files are in place, then mark what retention drops. Idempotent:
    the same step and path committed again by the same attempt answers the first record."""
    if allocation.fenced or not allocation.active:
        raise Conflict(f"allocation {allocation.id} is no longer current; its checkpoint is not recorded")
    root = storage_for(JobSpec.model_validate(job.spec), job.id, default_uri)
    if not within(body.path, root) or normalised(body.path) == normalised(root):
        raise Unprocessable(f"checkpoint path {body.path!r} is outside this job's storage {root!r}")
    earlier = session.scalars(
        select(Checkpoint).where(Checkpoint.allocation_id == allocation.id, Checkpoint.step == body.step)
    ).first()
    if earlier is not None:
        if earlier.path == body.path:
            return earlier  # a retried commit whose answer was lost: recorded once
        raise Conflict(
            f"step {body.step} of attempt {allocation.attempt} was already committed at {earlier.path!r}; "
            "an attempt commits each step once"
        )
    row = Checkpoint(
        job_id=job.id,
        allocation_id=allocation.id,
        attempt=allocation.attempt,
        step=body.step,
        metrics=body.metrics,
        size_bytes=body.size_bytes,
        path=body.path,
        state=COMMITTED,
    )
    session.add(row)
    session.flush()
    committed = list(
        session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.state == COMMITTED))
    )
    keep = to_keep(committed, JobSpec.model_validate(job.spec).checkpoint)
    dropped = [c for c in committed if c.id not in keep]
    for checkpoint in dropped:
        transition_checkpoint(session, checkpoint, DELETING)
    session.flush()
    note_job_data(session, job.id)  # the job page lists it
    if dropped:
        note_task(session, DELETE_CHECKPOINTS_TASK, job.id)
    return row


def jobs_with_deletions(session: Session) -> list[int]:
    return list(session.scalars(select(Checkpoint.job_id).where(Checkpoint.state == DELETING).distinct()))


def delete_marked(session: Session, job_id: int) -> int:
    """Delete the files of DELETING checkpoints, then their rows. Idempotent; returns rows removed."""
    removed = 0
    for checkpoint in session.scalars(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.state == DELETING)
        .with_for_update(skip_locked=True)
    ):
        try:
            fs, path = fsspec.core.url_to_fs(checkpoint.path)
            if fs.exists(path):
                fs.rm(path, recursive=True)
        except Exception as exc:  # keep the row (retried next pass); one bad row stops no other
            log.warning("could not delete checkpoint %s: %s", checkpoint.path, exc)
            continue
        session.delete(checkpoint)
        removed += 1
    session.flush()
    return removed


def archive(path: str) -> Iterator[bytes]:
    """Stream a checkpoint folder as .tar.gz without holding it in memory."""
    import tarfile
    import threading
    from queue import Queue

    chunks: Queue[bytes | None] = Queue(maxsize=8)

    class _Pipe:
        def write(self, data: bytes) -> int:
            chunks.put(bytes(data))
            return len(data)

    def produce() -> None:
        fs, root = fsspec.core.url_to_fs(path)
        local = isinstance(fs, LocalFileSystem)
        try:
            with tarfile.open(fileobj=_Pipe(), mode="w|gz") as tar:  # type: ignore[call-overload]
                for name in sorted(fs.find(root)):
                    if local and not _inside(name, root):
                        continue  # a symlink out of the checkpoint (to /etc/passwd, say) is left out
                    relative = name[len(root) :].lstrip("/")
                    info = tarfile.TarInfo(relative)
                    info.size = fs.size(name)
                    with fs.open(name, "rb") as handle:
                        tar.addfile(info, handle)
        finally:
            chunks.put(None)

    threading.Thread(target=produce, daemon=True).start()
    while (chunk := chunks.get()) is not None:
        yield chunk


def _inside(name: str, root: str) -> bool:
    """A local file that is no symlink and resolves inside `root` (resolved too)."""
    return not os.path.islink(name) and os.path.realpath(name).startswith(os.path.realpath(root) + os.sep)
