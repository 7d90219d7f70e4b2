"""The Python SDK: the client of users, the CLI and the agents, on the shared transport
(`phalanx._transport`, which a training rank's senders use too).

Contract: every method raises `ApiError` for an HTTP error answer (with the server's message and
status; `Conflict`, a subclass, for a 409) and `httpx.TransportError` when the server cannot be
reached. Nothing is retried here: a caller that must survive an outage (the agent) wraps calls in
`reliably`, the one retry policy. One `Client` may be shared by threads.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from phalanx._transport import ApiError, Conflict, Transport, is_transient, reliably
from phalanx.schemas import (
    AgentLogBatches,
    AgentRegistered,
    AgentRegistration,
    AgentView,
    AgentWork,
    AllocationLogBatch,
    CheckpointView,
    JobDetail,
    JobSpec,
    JobState,
    JobView,
    LogLineIn,
    LogRecord,
    MetricPoint,
    NodeReport,
    NodeReports,
    ParamImportances,
    ProfileView,
    QueueView,
    ReportOutcome,
    ReportOutcomes,
    ScalingPoint,
    ScalingRequest,
    ScalingRunView,
    ScalingState,
    Study,
    StudyBest,
    StudyDetail,
    StudySpec,
    StudyState,
    TeamPolicyRequest,
    TeamView,
    TokenCreated,
    TokenView,
    UsageReport,
)
from phalanx.schemas.protocol import MAX_EXIT_REASON_CHARS

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_BUNDLE_BYTES = 64 * 1024 * 1024
BUNDLE_EXCLUDES = {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
M = TypeVar("M", bound=BaseModel)
__all__ = ["ApiError", "Client", "Conflict", "SpecError", "is_transient", "reliably"]


class SpecError(ValueError):
    """A job file that cannot be read or does not validate; the message names the field."""


def _load_yaml(path: Path, model: type[M], what: str) -> M:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SpecError(f"cannot read {what} {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpecError(f"{path} must be a mapping of {what} fields ({', '.join(list(model.model_fields)[:3])}, ...)")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors())
        raise SpecError(f"{path}: {problems}") from exc


def load_job_file(path: str | Path) -> tuple[JobSpec, Path]:
    """Read a YAML job file; returns the spec and its working directory (relative to the file)."""
    path = Path(path)
    spec = _load_yaml(path, JobSpec, "job file")
    return spec, (path.parent / spec.workdir).resolve()


def load_study_file(path: str | Path) -> tuple[StudySpec, Path]:
    """Read a YAML study file; returns the spec and its trials' working directory."""
    path = Path(path)
    spec = _load_yaml(path, StudySpec, "study file")
    return spec, (path.parent / spec.trial.workdir).resolve()


def pack_workdir(workdir: Path, max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES) -> bytes:
    """The job's working directory as a .tar.gz, without VCS and cache folders."""
    if not workdir.is_dir():
        raise SpecError(f"workdir {workdir} is not a directory")

    def _filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if BUNDLE_EXCLUDES.intersection(Path(info.name).parts) else info

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(workdir, arcname=".", filter=_filter)
    data = buffer.getvalue()
    if len(data) > max_bytes:
        raise SpecError(
            f"workdir {workdir} packs to {len(data) / 2**20:.1f} MiB, over the {max_bytes / 2**20:.0f} MiB cap; "
            "move data sets out of it (read them from shared storage) or point workdir at a smaller folder"
        )
    return data


class _StreamReader(io.RawIOBase):
    """A file-like view of an iterator of byte chunks, for tarfile's stream mode."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._pending = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        size = min(len(buffer), len(self._pending))
        buffer[:size], self._pending = self._pending[:size], self._pending[size:]
        return size


T = TypeVar("T")


def _long_poll(
    value: T,
    done: Callable[[T], bool],
    change: Callable[[T, float], T],
    timeout: float | None,
    what: Callable[[T], str],
) -> T:
    """Re-ask with `change(value, wait)` (a long-poll of at most 20 s) until `done(value)`;
    TimeoutError naming `what(value)` after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done(value):
        remaining = 20.0 if deadline is None else min(20.0, deadline - time.monotonic())
        if remaining <= 0:
            raise TimeoutError(f"{what(value)} after {timeout} s")
        value = change(value, remaining)
    return value


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or os.environ.get("PHALANX_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("PHALANX_TOKEN", "")
        self._transport = Transport(self.url, self.token, timeout)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._transport.request(method, path, **kwargs)

    def _get(self, model: type[M], path: str, **kwargs: Any) -> M:
        return model.model_validate_json(self._request("GET", path, **kwargs).content)

    def _list(self, model: type[M], path: str, **kwargs: Any) -> list[M]:
        return TypeAdapter(list[model]).validate_json(self._request("GET", path, **kwargs).content)  # type: ignore[valid-type]

    def healthy(self) -> bool:
        return self._transport.healthy()

    # --- jobs -------------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, workdir: Path | None = None) -> JobView:
        files: dict[str, Any] = {"spec": (None, spec.model_dump_json(), "application/json")}
        if workdir is not None:
            files["bundle"] = ("bundle.tar.gz", pack_workdir(workdir), "application/gzip")
        return JobView.model_validate_json(self._request("POST", "/jobs", files=files).content)

    def submit_file(self, path: str | Path) -> JobView:
        spec, workdir = load_job_file(path)
        return self.submit(spec, workdir)

    def get_job(self, job_id: int) -> JobDetail:
        return self._get(JobDetail, f"/jobs/{job_id}")

    def list_jobs(self, state: str | None = None, limit: int = 100, before: int | None = None) -> list[JobView]:
        """Jobs newest first; `before`: only those with a smaller id (the next page after that job)."""
        return self.jobs_page(state, limit, before)[0]

    def jobs_page(
        self, state: str | None = None, limit: int = 100, before: int | None = None
    ) -> tuple[list[JobView], int | None]:
        """A page of `list_jobs` and the `before` of the next page (None: this was the last)."""
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        if before is not None:
            params["before"] = before
        response = self._request("GET", "/jobs", params=params)
        following = response.headers.get("X-Next-Before")
        return TypeAdapter(list[JobView]).validate_json(response.content), int(following) if following else None

    def iter_jobs(self, state: str | None = None, page_size: int = 100) -> Iterator[JobView]:
        """Every job the token may read, newest first, a page at a time: each once, however many
        are submitted meanwhile (those are newer than the first page, so not among them)."""
        before: int | None = None
        while True:
            jobs, before = self.jobs_page(state, page_size, before)
            yield from jobs
            if before is None:
                return

    def kill_job(self, job_id: int) -> JobView:
        return JobView.model_validate_json(self._request("POST", f"/jobs/{job_id}/kill").content)

    def logs(self, job_id: int, rank: int | None = None, after: int = 0, limit: int = 1000) -> list[LogRecord]:
        params: dict[str, Any] = {"after": after, "limit": limit}
        if rank is not None:
            params["rank"] = rank
        return self._list(LogRecord, f"/jobs/{job_id}/logs", params=params)

    def metrics(
        self, job_id: int, name: str | None = None, limit: int = 100_000, all_attempts: bool = False, after: int = 0
    ) -> list[MetricPoint]:
        """Metric points, each step once; `all_attempts` adds the steps a restarted attempt re-did.
        A page of `limit` (100,000 at most): the next starts `after` the last point's `id`."""
        params: dict[str, Any] = {"limit": limit, "all_attempts": all_attempts, "after": after}
        if name:
            params["name"] = name
        return self._list(MetricPoint, f"/jobs/{job_id}/metrics", params=params)

    def get_job_change(self, job_id: int, state: JobState | str, wait: float = 20.0) -> JobDetail:
        """The job once its state is no longer `state`, or as it is after `wait` seconds (long-poll)."""
        params = {"state": JobState(state).value, "wait": wait}
        return self._get(JobDetail, f"/jobs/{job_id}", params=params, timeout=wait + 15)

    def wait(self, job_id: int, timeout: float | None = None) -> JobDetail:
        """Block until the job reaches a terminal state; TimeoutError after `timeout` seconds.

        Long-polls the server, which answers as soon as the job's state changes: no polling loop."""
        return _long_poll(
            self.get_job(job_id),
            lambda job: job.state.is_terminal,
            lambda job, wait: self.get_job_change(job_id, job.state, wait=wait),
            timeout,
            lambda job: f"job {job_id} is still {job.state.value}",
        )

    # --- scaling runs ---------------------------------------------------------------------------

    def start_scaling(
        self, spec: JobSpec, workdir: Path | None, nodes: list[int], steps: int = 100, warmup: int = 10
    ) -> ScalingRunView:
        """Start a scaling run on the server: `spec` at each size in `nodes` in turn (smallest
        first), each until rank 0 has reported `warmup + steps` steps (see `phalanx.scaling`)."""
        request = ScalingRequest(nodes=nodes, steps=steps, warmup=warmup)
        files: dict[str, Any] = {
            "spec": (None, spec.model_dump_json(), "application/json"),
            "request": (None, request.model_dump_json(), "application/json"),
        }
        if workdir is not None:
            files["bundle"] = ("bundle.tar.gz", pack_workdir(workdir), "application/gzip")
        return ScalingRunView.model_validate_json(self._request("POST", "/scaling", files=files).content)

    def get_scaling(self, run_id: int) -> ScalingRunView:
        return self._get(ScalingRunView, f"/scaling/{run_id}")

    def cancel_scaling(self, run_id: int) -> ScalingRunView:
        return ScalingRunView.model_validate_json(self._request("POST", f"/scaling/{run_id}/cancel").content)

    def wait_scaling(
        self, run_id: int, timeout: float | None = None, progress: Callable[[ScalingRunView], None] | None = None
    ) -> ScalingRunView:
        """Block until the run ended (long-polls: the server answers as each size starts or is
        measured); TimeoutError after `timeout` seconds."""

        def change(run: ScalingRunView, wait: float) -> ScalingRunView:
            params = {"version": run.version, "wait": wait}
            changed = self._get(ScalingRunView, f"/scaling/{run_id}", params=params, timeout=wait + 15)
            if progress is not None and changed.version != run.version:
                progress(changed)
            return changed

        return _long_poll(
            self.get_scaling(run_id),
            lambda run: run.state.is_terminal,
            change,
            timeout,
            lambda run: f"scaling run {run_id} is still {run.state.value} ({len(run.points)} sizes measured)",
        )

    def scaling(
        self,
        spec: JobSpec,
        workdir: Path | None,
        nodes: list[int],
        steps: int = 100,
        warmup: int = 10,
        timeout: float | None = None,
    ) -> list[ScalingPoint]:
        """Run a scaling run to its end: throughput, scaling efficiency and communication share per
        size. `phalanx.scaling.ScalingError` when a size could not be measured."""
        from phalanx.scaling import ScalingError

        run = self.wait_scaling(self.start_scaling(spec, workdir, nodes, steps, warmup).id, timeout)
        if run.state is not ScalingState.COMPLETED:
            raise ScalingError(f"scaling run {run.id} {run.state.value}: {run.reason}")
        return run.points

    # --- profiles -------------------------------------------------------------------------------

    def request_profile(self, job_id: int, steps: int = 20) -> ProfileView:
        """Ask every rank of the running job to record torch.profiler traces of its next `steps`
        optimizer steps (409 unless it runs, or while another profile of it records)."""
        response = self._request("POST", f"/jobs/{job_id}/profiles", json={"steps": steps})
        return ProfileView.model_validate_json(response.content)

    def profiles(self, job_id: int) -> list[ProfileView]:
        return self._list(ProfileView, f"/jobs/{job_id}/profiles")

    def get_profile(self, job_id: int, profile_id: int) -> ProfileView:
        return self._get(ProfileView, f"/jobs/{job_id}/profiles/{profile_id}")

    def wait_profile(
        self,
        job_id: int,
        profile_id: int,
        timeout: float | None = None,
        progress: Callable[[ProfileView], None] | None = None,
    ) -> ProfileView:
        """Block until every rank has answered or the profile stopped recording (long-polls the
        server, which answers as each rank's trace arrives); TimeoutError after `timeout` s."""

        def change(view: ProfileView, wait: float) -> ProfileView:
            params = {"answered": len(view.ranks), "wait": min(wait, 20.0)}
            changed = self._get(ProfileView, f"/jobs/{job_id}/profiles/{profile_id}", params=params, timeout=wait + 15)
            if progress is not None and len(changed.ranks) != len(view.ranks):
                progress(changed)
            return changed

        return _long_poll(
            self.get_profile(job_id, profile_id),
            lambda view: view.state != "recording",
            change,
            timeout,
            lambda view: f"profile {profile_id} of job {job_id} has {len(view.ranks)} of {view.world_size} traces",
        )

    def delete_profile(self, job_id: int, profile_id: int) -> None:
        self._request("DELETE", f"/jobs/{job_id}/profiles/{profile_id}")

    def download_trace(self, job_id: int, profile_id: int, rank: int, dest: str | Path) -> Path:
        """Write one rank's gzipped Chrome trace into the folder `dest` (Perfetto opens it)."""
        folder = Path(dest)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"job-{job_id}-profile-{profile_id}-rank-{rank}.json.gz"
        response = self._request("GET", f"/jobs/{job_id}/profiles/{profile_id}/ranks/{rank}/trace")
        target.write_bytes(response.content)
        return target

    def pause_job(self, job_id: int) -> JobView:
        return JobView.model_validate_json(self._request("POST", f"/jobs/{job_id}/pause").content)

    def resume_job(self, job_id: int) -> JobView:
        return JobView.model_validate_json(self._request("POST", f"/jobs/{job_id}/resume").content)

    def checkpoints(self, job_id: int) -> list[CheckpointView]:
        return self._list(CheckpointView, f"/jobs/{job_id}/checkpoints")

    def download_checkpoint(self, job_id: int, dest: str | Path, step: int | None = None) -> CheckpointView:
        """Unpack a checkpoint's files into `dest` (the newest when `step` is None)."""
        available = self.checkpoints(job_id)
        if not available:
            raise ApiError(404, f"job {job_id} has no committed checkpoint yet")
        chosen = available[-1] if step is None else next((c for c in available if c.step == step), None)
        if chosen is None:
            steps = ", ".join(str(c.step) for c in available)
            raise ApiError(404, f"job {job_id} has no checkpoint at step {step}; it has steps {steps}")
        target = Path(dest)
        target.mkdir(parents=True, exist_ok=True)
        path = f"/jobs/{job_id}/checkpoints/{chosen.step}/archive"
        with (
            self._transport.stream("GET", path, timeout=600) as response,
            tarfile.open(fileobj=_StreamReader(response.iter_bytes()), mode="r|gz") as tar,
        ):
            tar.extractall(target, filter="data")
        return chosen

    # --- studies -----------------------------------------------------------------------------------

    def create_study(self, spec: StudySpec, workdir: Path | None = None) -> Study:
        files: dict[str, Any] = {"spec": (None, spec.model_dump_json(), "application/json")}
        if workdir is not None:
            files["bundle"] = ("bundle.tar.gz", pack_workdir(workdir), "application/gzip")
        return Study.model_validate_json(self._request("POST", "/studies", files=files).content)

    def create_study_file(self, path: str | Path) -> Study:
        spec, workdir = load_study_file(path)
        return self.create_study(spec, workdir)

    def list_studies(self, state: str | None = None, limit: int = 100) -> list[Study]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        return self._list(Study, "/studies", params=params)

    def get_study(self, study_id: int) -> StudyDetail:
        return self._get(StudyDetail, f"/studies/{study_id}")

    def get_study_change(self, study_id: int, version: str, wait: float = 20.0) -> StudyDetail:
        """The study once it (or a trial) differs from `version`, or after `wait` seconds (long-poll)."""
        params = {"version": version, "wait": wait}
        return self._get(StudyDetail, f"/studies/{study_id}", params=params, timeout=wait + 15)

    def wait_study(self, study_id: int, timeout: float | None = None) -> StudyDetail:
        """Block until the study is no longer RUNNING (COMPLETED, FAILED or STOPPED); TimeoutError
        after `timeout` seconds. Long-polls: the server answers as soon as a trial changes."""
        return _long_poll(
            self.get_study(study_id),
            lambda study: study.state is not StudyState.RUNNING,
            lambda study, wait: self.get_study_change(study_id, study.version, wait=wait),
            timeout,
            lambda _: f"study {study_id} is still RUNNING",
        )

    def stop_study(self, study_id: int) -> Study:
        return Study.model_validate_json(self._request("POST", f"/studies/{study_id}/stop").content)

    def resume_study(self, study_id: int) -> Study:
        return Study.model_validate_json(self._request("POST", f"/studies/{study_id}/resume").content)

    def best_trials(self, study_id: int) -> StudyBest:
        return self._get(StudyBest, f"/studies/{study_id}/best")

    def param_importances(self, study_id: int, method: str = "ped_anova") -> ParamImportances:
        return self._get(ParamImportances, f"/studies/{study_id}/importance", params={"method": method})

    # --- admin ------------------------------------------------------------------------------------

    def agents(self) -> list[AgentView]:
        return self._list(AgentView, "/agents")

    def drain_agent(self, agent_id: int) -> AgentView:
        return AgentView.model_validate_json(self._request("POST", f"/agents/{agent_id}/drain").content)

    def undrain_agent(self, agent_id: int) -> AgentView:
        return AgentView.model_validate_json(self._request("POST", f"/agents/{agent_id}/undrain").content)

    def create_token(self, kind: str, name: str, expires_in_s: int | None = None) -> TokenCreated:
        """Admin: a new token (a user token makes a new user); the value is shown once."""
        body = {"kind": kind, "name": name, "expires_in_s": expires_in_s}
        return TokenCreated.model_validate_json(self._request("POST", "/tokens", json=body).content)

    def tokens(self) -> list[TokenView]:
        """Your tokens (an admin's: all), without their values."""
        return self._list(TokenView, "/tokens")

    def revoke_token(self, token_id: int) -> None:
        self._request("DELETE", f"/tokens/{token_id}")

    def create_team(self, name: str) -> TeamView:
        """Cluster admin: a new, empty team."""
        return TeamView.model_validate_json(self._request("POST", "/teams", json={"name": name}).content)

    def teams(self) -> list[TeamView]:
        """Your teams with their members (a cluster admin's: all)."""
        return self._list(TeamView, "/teams")

    def team(self, name: str) -> TeamView:
        return self._get(TeamView, f"/teams/{name}")

    def set_team_member(self, team: str, user: str, role: str = "member") -> TeamView:
        """Add `user` to `team` with `role` ("member" or "admin"), or change their role."""
        response = self._request("PUT", f"/teams/{team}/members/{user}", json={"role": role})
        return TeamView.model_validate_json(response.content)

    def remove_team_member(self, team: str, user: str) -> TeamView:
        return TeamView.model_validate_json(self._request("DELETE", f"/teams/{team}/members/{user}").content)

    def set_team_policy(
        self,
        team: str,
        *,
        weight: float | None = None,
        guarantee: Mapping[str, int | None] | None = None,
        limit: Mapping[str, int | None] | None = None,
        user_limit: Mapping[str, int | None] | None = None,
    ) -> TeamView:
        """Cluster admin: the team's fair-share weight, and per slot type its guarantee, its limit and
        each member's limit (None for a slot type drops it); what is left out stays as it is."""
        body = TeamPolicyRequest.model_validate(
            {"weight": weight, "guarantee": guarantee, "limit": limit, "user_limit": user_limit}
        )
        response = self._request("PATCH", f"/teams/{team}", json=body.model_dump(mode="json", exclude_none=True))
        return TeamView.model_validate_json(response.content)

    def hold_team(self, team: str) -> TeamView:
        """The team's queued jobs wait until `release_team` (its admins, cluster admins)."""
        return TeamView.model_validate_json(self._request("POST", f"/teams/{team}/hold").content)

    def release_team(self, team: str) -> TeamView:
        return TeamView.model_validate_json(self._request("POST", f"/teams/{team}/release").content)

    def hold_job(self, job_id: int) -> JobView:
        """The job is not placed until `release_job` (an admin of its team, a cluster admin)."""
        return JobView.model_validate_json(self._request("POST", f"/jobs/{job_id}/hold").content)

    def release_job(self, job_id: int) -> JobView:
        return JobView.model_validate_json(self._request("POST", f"/jobs/{job_id}/release").content)

    def queue(self, limit: int = 1000) -> QueueView:
        """The queued jobs in placement order, each with its place, reason and estimated start."""
        return self._get(QueueView, "/queue", params={"limit": limit})

    def usage(self, since: datetime | None = None, until: datetime | None = None) -> UsageReport:
        """Slot-hours by user, team and slot type (default: the last 7 days)."""
        params = {key: value.isoformat() for key, value in (("since", since), ("until", until)) if value is not None}
        return self._get(UsageReport, "/usage", params=params)

    # --- agent protocol ---------------------------------------------------------------------------

    def register_agent(self, registration: AgentRegistration, cluster_token: str | None = None) -> AgentRegistered:
        """Register with `cluster_token` (the cluster's agent token; default: this client's). The
        answer carries the agent's new token, which every later agent call must use (`use_token`);
        a restarting agent proves which it is with its previous one (`registration.agent_token`)."""
        headers = {"Authorization": f"Bearer {cluster_token}"} if cluster_token else None
        body = registration.model_dump(mode="json")
        return AgentRegistered.model_validate_json(
            self._request("POST", "/agents/register", json=body, headers=headers).content
        )

    def use_token(self, token: str) -> None:
        """Send `token` from now on (an agent switches to its own after registering)."""
        self.token = token
        self._transport.set_token(token)

    def heartbeat(self, agent_id: int) -> None:
        self._request("POST", f"/agents/{agent_id}/heartbeat")

    def agent_work(self, agent_id: int, version: str = "", wait: float = 0.0) -> AgentWork:
        params = {"version": version, "wait": wait}
        return self._get(AgentWork, f"/agents/{agent_id}/work", params=params, timeout=wait + 15)

    def download_bundle(self, job_id: int) -> bytes:
        return self._request("GET", f"/jobs/{job_id}/bundle", timeout=300).content

    def report_nodes(self, agent_id: int, reports: Sequence[NodeReport]) -> list[ReportOutcome]:
        """Reports of the agent's nodes (started, exit, rendezvous) in one call, applied in order,
        each on its own: one outcome per report, 204 or what its own call would have refused with."""
        body = NodeReports(reports=list(reports)).model_dump(mode="json")
        answer = self._request("POST", f"/agents/{agent_id}/reports", json=body)
        return ReportOutcomes.model_validate_json(answer.content).results

    def ship_log_batches(self, agent_id: int, batches: Sequence[AllocationLogBatch]) -> list[ReportOutcome]:
        """Lines of several of the agent's allocations in one call, each batch stored (once, by its
        `batch_id`) or refused on its own: one outcome per batch."""
        body = AgentLogBatches(batches=list(batches)).model_dump(mode="json", exclude_none=True)
        answer = self._request("POST", f"/agents/{agent_id}/logs", json=body)
        return ReportOutcomes.model_validate_json(answer.content).results

    def set_rendezvous(self, agent_id: int, allocation_id: int, master_port: int) -> None:
        path = f"/agents/{agent_id}/allocations/{allocation_id}/rendezvous"
        self._request("POST", path, json={"master_port": master_port})

    def node_started(self, agent_id: int, allocation_id: int, node_rank: int) -> None:
        self._request("POST", f"/agents/{agent_id}/allocations/{allocation_id}/started", json={"node_rank": node_rank})

    def node_exited(
        self, agent_id: int, allocation_id: int, node_rank: int, exit_code: int, reason: str = "", cause: str = "run"
    ) -> None:
        """`cause`: "run" (the node ran and ended), "environment" (its runtime environment could not
        be built: the job fails), "stopped" (it ended because Phalanx asked it to stop)."""
        body = {
            "node_rank": node_rank,
            "exit_code": exit_code,
            "reason": reason[-MAX_EXIT_REASON_CHARS:],
            "cause": cause,
        }
        self._request("POST", f"/agents/{agent_id}/allocations/{allocation_id}/exit", json=body)

    def report_environment_lock(self, agent_id: int, allocation_id: int, lock: str) -> str:
        """Node rank 0's resolution of the job's runtime environment; the job's lock (the first reported)."""
        path = f"/agents/{agent_id}/allocations/{allocation_id}/environment"
        return str(self._request("POST", path, json={"lock": lock}).json()["lock"])

    def ship_logs(
        self, agent_id: int, allocation_id: int, lines: Iterable[LogLineIn], batch_id: str | None = None
    ) -> None:
        """`batch_id`: the same for every retry of one batch, so that the server stores it once."""
        body: dict[str, Any] = {"lines": [line.model_dump() for line in lines]}
        if batch_id is not None:
            body["batch_id"] = batch_id
        self._request("POST", f"/agents/{agent_id}/allocations/{allocation_id}/logs", json=body)
