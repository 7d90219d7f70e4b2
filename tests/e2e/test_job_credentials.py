"""A job's script hunts for every credential it can find (its environment, every process's
environment and command line it can read, its workdir and the folders above it, its home) and
tries each against the API: every answer is 401, 403 or 404. The agent runs each node as a uid of
its own (`--run-as FIRST-LAST`), so neither the agent's token nor another job's credential is
within reach; the node's folder is gone once the node ended (`--workdir-ttl 0`)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.schemas import JobSpec, JobState, Resources
from tests.conftest import call_failed
from tests.processes import Stack, wait_for

pytestmark = pytest.mark.e2e

PROBE = r"""
import glob, json, os, re, urllib.error, urllib.request

TOKEN = re.compile(rb"phx_[a-z]_[A-Za-z0-9_\-]{8,}")
found = {}

def scan(path):
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return
    for token in TOKEN.findall(data):
        found.setdefault(token.decode(), path)

for key, value in os.environ.items():
    for token in TOKEN.findall(value.encode()):
        found.setdefault(token.decode(), "env " + key)
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    scan(path)
here = os.getcwd()
roots = [here] + [os.path.dirname(here)] + [os.path.dirname(os.path.dirname(here))]
roots += [os.path.dirname(os.path.dirname(os.path.dirname(here))), os.path.expanduser("~")]
scanned = 0
for root in roots:
    for folder, dirs, files in os.walk(root):
        for name in files:
            scanned += 1
            if scanned < 20000:
                scan(os.path.join(folder, name))

url = os.environ["PHALANX_URL"] + "/api/v1"
hp = json.loads(os.environ["PHALANX_HPARAMS"])
victim, victim_allocation = hp["victim"], hp["victim_allocation"]
own = int(os.environ["PHALANX_ALLOCATION_ID"])
probes = [
    ("GET", "/jobs", None), ("GET", f"/jobs/{victim}", None), ("GET", f"/jobs/{victim}/logs", None),
    ("GET", f"/jobs/{victim}/bundle", None), ("POST", f"/jobs/{victim}/kill", None),
    ("GET", "/agents", None), ("GET", "/agents/1/work", None), ("POST", "/agents/1/heartbeat", None),
    ("POST", "/agents/register", {"name": "evil", "address": "127.0.0.1", "cpu_slots": 64}),
    ("POST", "/tokens", {"kind": "user", "name": "evil"}), ("GET", "/tokens", None), ("GET", "/teams", None),
    ("POST", f"/allocations/{victim_allocation}/metrics",
     {"records": [{"rank": 0, "step": 1, "time": 1.0, "values": {"x": 1.0}}]}),
    ("POST", f"/allocations/{victim_allocation}/checkpoints", {"step": 1, "path": "file:///tmp/x", "size_bytes": 1}),
    ("POST", "/agents/1/allocations/%d/exit" % victim_allocation, {"node_rank": 0, "exit_code": 0}),
]
answers = []
for token, where in sorted(found.items()):
    for method, path, body in probes:
        request = urllib.request.Request(url + path, method=method, headers={"Authorization": "Bearer " + token})
        if body is not None:
            request.data = json.dumps(body).encode()
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                status = answer.status
        except urllib.error.HTTPError as error:
            status = error.code
        answers.append([where, method, path, status])
report = {"tokens": sorted(set(found.values())), "answers": answers, "uid": os.getuid()}
print("PROBE " + json.dumps(report), flush=True)
"""


def interpreter_runs_as(uid: int) -> bool:
    try:
        done = subprocess.run([sys.executable, "-c", "import torch"], user=uid, group=uid, capture_output=True)
    except OSError:
        return False
    return done.returncode == 0


@pytest.fixture
def jailed(clean_db: str, clean_redis: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """Server, scheduler, and one two-slot agent running each node as a uid of its own."""
    if not interpreter_runs_as(20000):
        message = f"{sys.executable} cannot run as an unprivileged uid (e.g. /root is not searchable: chmod o+x /root)"
        if os.environ.get("CI"):
            pytest.fail(message)  # .ci/run makes it reachable
        pytest.skip(message)
    work = Path(tempfile.mkdtemp(prefix="phalanx-jail-"))
    work.chmod(0o755)
    # tokens of its own: the fixed test tokens may lie around the machine (other tests' logs, a
    # fuzzer's command line), where this job's hunt would find them
    secrets_ = {
        f"PHALANX_{kind}_TOKEN": f"phx_{kind[0].lower()}_{secrets.token_urlsafe(24)}" for kind in ("ADMIN", "AGENT")
    }
    stack = Stack(tmp_path, clean_db, clean_redis, **secrets_)
    try:
        stack.start_server()
        stack.start_scheduler()
        stack.start_agent("jail", cpu_slots=2, work_dir=work, extra=("--run-as", "20000-20001", "--workdir-ttl", "0"))
        stack.wait_agents(1)
        stack.jail_dir = work  # type: ignore[attr-defined]
        yield stack
        if call_failed(request):
            print(stack.dump())
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)


def test_a_job_gets_nowhere_with_any_credential_it_can_find(jailed: Stack, tmp_path: Path) -> None:
    with jailed.client() as admin:
        mallory_token = admin.create_token("user", "mallory").token
        victim_token = admin.create_token("user", "victim").token
    from phalanx.client import Client

    with Client(jailed.url, victim_token) as victim:
        long_job = JobSpec(
            name="victim",
            entrypoint="python -c 'import time; time.sleep(600)'",
            resources=Resources(nodes=1),
            env={"SECRET": "victims-own"},
        )
        victim_job = victim.submit(long_job)
        wait_for(lambda: victim.get_job(victim_job.id).state is JobState.RUNNING, 120, "the victim's job to run")
        victim_allocation = victim.get_job(victim_job.id).allocations[-1].id

    with Client(jailed.url, mallory_token) as mallory:
        probe = JobSpec(
            name="probe",
            entrypoint="python probe.py",
            resources=Resources(nodes=1),
            hyperparameters={"victim": victim_job.id, "victim_allocation": victim_allocation},
        )
        code = tmp_path / "probe"
        code.mkdir()
        (code / "probe.py").write_text(PROBE)
        job = mallory.submit(probe, code)
        final = mallory.wait(job.id, timeout=240)
        assert final.state is JobState.COMPLETED, (final.failure_reason, jailed.log("jail")[-3000:])
        lines = [line.line for line in mallory.logs(job.id, limit=10_000) if line.line.startswith("PROBE ")]
    (line,) = lines
    report = json.loads(line.removeprefix("PROBE "))
    assert report["uid"] in (20000, 20001)
    assert "env PHALANX_TOKEN" in report["tokens"]  # the hunt found at least its own credential
    allowed = [answer for answer in report["answers"] if answer[3] not in (401, 403, 404)]
    assert allowed == [], allowed
    assert len(report["answers"]) >= 15

    with Client(jailed.url, victim_token) as victim:
        assert victim.get_job(victim_job.id).state is JobState.RUNNING  # untouched
        victim.kill_job(victim_job.id)
    node_dir = jailed.jail_dir / f"alloc-{final.allocations[-1].id}-node-0"  # type: ignore[attr-defined]
    wait_for(lambda: not node_dir.exists(), 30, "the probe's node folder to be removed")
    assert (jailed.jail_dir / "agent-token").stat().st_mode & 0o077 == 0  # the agent's own, unreadable to jobs
