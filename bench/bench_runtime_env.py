"""Runtime environments: what building one costs against plain uv, and what using a built one
costs a job's start.

    python bench/bench_runtime_env.py [--part build|start|both] [--repeat 5] [--backend embedded|postgres]

build: the same requirements (three pure-Python packages and one with a compiled wheel, none of
which the agents' interpreter has) resolved and installed
  - by Phalanx: `Environments.resolve` then `acquire` into a fresh `envs/` folder, exactly what node
    rank 0 of a job's first attempt does, and
  - by plain uv: `uv venv` then `uv pip install -r requirements.in` into a fresh virtual environment,
with this node's pip configuration for both (the same indexes). Each pair alternates its order.
"cold": each side with an empty uv cache of its own (downloads included); "warm": each side with a
cache already holding the packages (a node that built other environments with them). Goal: Phalanx
≤ 1.1x plain uv.

start: submit → first optimizer step of the digits example (2 nodes x 1 CPU slot) with a
`runtime_env` whose environment is already built on both agents, against the same job without
`runtime_env`, pairs alternating on one stack. Goal: ≤ +0.5 s. Each job with `runtime_env` still
resolves its requirements once (node rank 0, ~0.1 s with uv's cache) and reports its lock.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import SETTLE_S, log, median, phalanx_run, stack, wait_quiet
from worker_agent.environments import Environments, EnvironmentsConfig, PackageIndex

REQUIREMENTS = ["tabulate", "toolz", "more-itertools", "msgpack"]  # msgpack: a compiled wheel
GOAL_BUILD_RATIO = 1.1
GOAL_START_OVERHEAD_S = 0.5
EPOCHS = 1


def phalanx_build(root: Path, cache: Path) -> float:
    envs = Environments(EnvironmentsConfig(root=root))
    _ = envs.index, envs.interpreter  # read once per agent, not per build
    (root / ".uv-cache").parent.mkdir(parents=True, exist_ok=True)
    if cache.exists():
        (root / ".uv-cache").symlink_to(cache)
    started = time.perf_counter()
    lock = envs.resolve(REQUIREMENTS, lambda _: None)
    envs.acquire(lock, lambda _: None).release()
    return time.perf_counter() - started


def plain_uv_build(root: Path, cache: Path, index: PackageIndex) -> float:
    from uv import find_uv_bin

    uv = find_uv_bin()
    env = {**_env(), "UV_CACHE_DIR": str(cache if cache.exists() else root / "cache"), **index.uv_env()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "requirements.in").write_text("".join(f"{r}\n" for r in REQUIREMENTS))
    started = time.perf_counter()
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(root / "venv")], env=env, check=True)
    install = [uv, "pip", "install", "--quiet", "--python", str(root / "venv" / "bin" / "python")]
    install += ["-r", str(root / "requirements.in"), *index.uv_args(None)]
    subprocess.run(install, env=env, check=True)
    return time.perf_counter() - started


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("UV_")}


def measure_build(repeat: int, warm: bool) -> dict[str, object]:
    index = PackageIndex.from_pip()
    plain: list[float] = []
    phalanx: list[float] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-env-") as scratch:
        base = Path(scratch)
        cache = base / "shared-cache"
        if warm:  # fill a cache both sides then use: downloads and wheel unpacking are done once
            cache.mkdir()
            plain_uv_build(base / "fill", cache, index)
        for i in range(repeat):
            order = ("plain", "phalanx") if i % 2 == 0 else ("phalanx", "plain")
            for side in order:
                root = base / f"{side}-{i}"
                root.mkdir()
                if side == "plain":
                    plain.append(plain_uv_build(root, cache, index))
                else:
                    phalanx.append(phalanx_build(root / "envs", cache))
                shutil.rmtree(root, ignore_errors=True)
            kind = "warm" if warm else "cold"
            log(f"build ({kind}) {i + 1}/{repeat}: plain {plain[-1]:.3f} s, phalanx {phalanx[-1]:.3f} s")
    ratio = median(phalanx) / median(plain)
    return {
        "phalanx_s": round(median(phalanx), 3),
        "plain_uv_s": round(median(plain), 3),
        "ratio": round(ratio, 3),
        "goal_ratio": GOAL_BUILD_RATIO,
        "ok": ratio <= GOAL_BUILD_RATIO,
        "phalanx_runs": [round(s, 3) for s in phalanx],
        "plain_runs": [round(s, 3) for s in plain],
    }


def measure_start(backend: str, repeat: int) -> dict[str, object]:
    runtime_env: dict[str, object] = {"runtime_env": {"pip": REQUIREMENTS}}
    with_env: list[float] = []
    without_env: list[float] = []
    with stack(backend) as running:
        phalanx_run(running, EPOCHS, spec_update=runtime_env)  # builds the environment on both agents
        for i in range(repeat):
            order = (False, True) if i % 2 == 0 else (True, False)
            for uses_env in order:
                wait_quiet(running.pids)
                time.sleep(SETTLE_S)
                latency = phalanx_run(running, EPOCHS, spec_update=runtime_env if uses_env else None).start_latency
                (with_env if uses_env else without_env).append(latency)
            log(f"start {i + 1}/{repeat}: without {without_env[-1]:.2f} s, with runtime_env {with_env[-1]:.2f} s")
    overhead = median(with_env) - median(without_env)
    return {
        "backend": backend,
        "with_env_s": round(median(with_env), 3),
        "without_env_s": round(median(without_env), 3),
        "overhead_s": round(overhead, 3),
        "goal_overhead_s": GOAL_START_OVERHEAD_S,
        "ok": overhead <= GOAL_START_OVERHEAD_S,
        "with_env_runs": [round(s, 3) for s in with_env],
        "without_env_runs": [round(s, 3) for s in without_env],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("build", "start", "both"), default="both")
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    report: dict[str, object] = {"bench": "runtime_env", "repeat": args.repeat, "requirements": REQUIREMENTS}
    if args.part in ("build", "both"):
        report["build_cold"] = measure_build(args.repeat, warm=False)
        report["build_warm"] = measure_build(args.repeat, warm=True)
    if args.part in ("start", "both"):
        report["start"] = measure_start(args.backend, args.repeat)
    report["ok"] = all(v["ok"] for v in report.values() if isinstance(v, dict))
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
