"""Checkpoints on an S3 bucket (a local moto server) instead of a shared folder: ranks write
through s3fs, the server commits, lists, downloads and deletes (retention) through fsspec."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
from moto.server import ThreadedMotoServer

from phalanx.client import load_job_file
from phalanx.schemas import JobState
from tests.processes import REPO, free_port, two_agent_stack, wait_for

pytestmark = pytest.mark.e2e
SCRIPTED = REPO / "examples" / "scripted" / "job.yaml"
BUCKET = "phalanx-checkpoints"


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def test_checkpoints_on_s3_commit_resume_download_and_retain(
    clean_db: str, clean_redis: str, tmp_path: Path, s3_endpoint: str
) -> None:
    credentials = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # fsspec reads FSSPEC_<PROTOCOL>_<ARGUMENT> from the environment: every process (server, agents,
    # the ranks they start) reaches the same endpoint without code of ours knowing about S3.
    # The cluster allows the bucket as a checkpoint root; a job names a path in it.
    env = {**credentials, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint, "PHALANX_CHECKPOINT_ROOTS": f"s3://{BUCKET}"}
    bucket = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3_endpoint)
    bucket.mkdir(BUCKET)

    with two_agent_stack(tmp_path, clean_db, clean_redis, **env) as stack:
        spec, workdir = load_job_file(SCRIPTED)
        hyper = {"steps": 40, "step_seconds": 0.02, "checkpoint_every": 10, "checkpoint_mb": 0.25}
        policy = spec.checkpoint.model_copy(update={"storage": f"s3://{BUCKET}/runs", "keep_last": 2})
        spec = spec.model_copy(update={"hyperparameters": hyper, "checkpoint": policy})
        with stack.client() as client:
            job = client.submit(spec, workdir)
            final = client.wait(job.id, timeout=180)
            assert final.state is JobState.COMPLETED, final.failure_reason
            kept = client.checkpoints(job.id)
            logs = [f"[rank {r.rank}] {r.line}" for r in client.logs(job.id, limit=10_000) if r.stream == "stderr"]
            assert kept, "no checkpoint was committed; the ranks' stderr:\n" + "\n".join(logs[-40:])
            # steps 0, 10, 20, 30 were saved; keep_last=2 keeps the newest two
            assert [c.step for c in kept] == [20, 30]
            assert all(c.path.startswith(f"s3://{BUCKET}/runs/") for c in kept)
            archive = client.download_checkpoint(job.id, tmp_path / "restored", step=30)
            assert archive.step == 30
        restored = sorted(p.name for p in (tmp_path / "restored").rglob("*") if p.is_file())
        assert restored == ["state.pt"], restored

        def folders() -> set[str]:
            bucket.invalidate_cache()
            return {key.split("/")[-2] for key in bucket.find(f"{BUCKET}/runs")}

        # the dropped checkpoints' objects are deleted from the bucket (their rows only after that)
        wanted = {Path(c.path).name for c in kept}
        wait_for(lambda: folders() == wanted, 60, f"the bucket to hold exactly {sorted(wanted)}")
