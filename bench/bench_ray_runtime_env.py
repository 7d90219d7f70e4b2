"""Ray's runtime_env on the same requirements as bench/bench_runtime_env.py, for comparison: cold
(first use of the environment in this Ray session) and cached (the same environment, a fresh
worker), with Ray's pip and uv plugins. Each figure: the task's round trip minus the same task's
round trip without runtime_env (a fresh worker every time: max_calls=1).

Ray is not a dependency of Phalanx; run this in a virtual environment of its own:

    .venv/bin/uv venv /tmp/rayvenv --python python3.11
    .venv/bin/uv pip install --python /tmp/rayvenv/bin/python "ray[default]" pip virtualenv
    /tmp/rayvenv/bin/python bench/bench_ray_runtime_env.py

(Ray's pip plugin makes a virtualenv from the interpreter it runs on and installs with its pip:
without pip in that venv it fails with "No module named pip".)
"""

import json
import statistics
import sys
import time

import ray

REQS = ["tabulate", "toolz", "more-itertools", "msgpack"]


@ray.remote(max_calls=1)
def probe(needs: bool) -> int:
    if needs:
        import importlib

        for module in ("more_itertools", "msgpack", "tabulate", "toolz"):  # what the environment added
            importlib.import_module(module)
    return 1


def timed(**options):
    t = time.perf_counter()
    ray.get(probe.options(**options).remote("runtime_env" in options))
    return time.perf_counter() - t


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
timed()  # the first worker of the session
base = statistics.median(timed() for _ in range(5))
out = {"bench": "ray_runtime_env", "ray": ray.__version__, "plain_task_s": round(base, 3)}
for kind in ("pip", "uv"):
    env = {kind: list(REQS)}
    cold = timed(runtime_env=env)
    cached = statistics.median(timed(runtime_env=env) for _ in range(5))
    out[kind] = {
        "cold_s": round(cold, 3),
        "cold_added_s": round(cold - base, 3),
        "cached_s": round(cached, 3),
        "cached_added_s": round(cached - base, 3),
    }
    print(kind, out[kind], file=sys.stderr)
print(json.dumps(out))
