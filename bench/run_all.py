"""Run every benchmark one after the other; print their JSON lines and a summary table.

    python -m bench.run_all [--skip NAME ...] [--only NAME ...] [--quick] [--out bench/results.jsonl]

Each benchmark runs as its own process (one at a time: they measure ratios on a shared machine),
so one that crashes leaves the others' figures intact. The JSON lines go to stdout and to --out.
Exit status 0 only when every benchmark met its goal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
Result = dict[str, object]


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()  # replaces args under --quick
    summary: Callable[[Result], tuple[str, str]] = lambda r: ("", "")  # (figure, goal)


def _latency_summary(r: Result) -> tuple[str, str]:
    goals = r.get("goal_overhead_s")
    measured = [name for name in ("embedded", "postgres") if f"{name}_overhead_s" in r]
    figures = [f"{name} {r[f'{name}_overhead_s']:+.2f} s" for name in measured]
    goal = ", ".join(f"{k} <= +{v} s" for k, v in goals.items()) if isinstance(goals, dict) else ""
    return "; ".join(figures), goal


BENCHMARKS = (
    Benchmark(
        "placement",
        "bench_placement.py",
        summary=lambda r: (
            f"median {r['median_s']} s, with sharing {r['sharing_median_s']} s, full cluster "
            f"{r['full_cluster_median_s']} s",
            f"<= {r['goal_s']} s",
        ),
    ),
    Benchmark(
        "fair_share",
        "bench_fair_share.py",
        quick_args=("--seeds", "7", "--compare", ""),
        summary=lambda r: (
            "max share error "
            + ", ".join(f"{seed} {run['fair_share']['max_share_error_pp']} pp" for seed, run in r["runs"].items()),
            f"<= 5 pp; guaranteed wait <= {r['guaranteed_wait_bound_s']} s",
        ),
    ),
    Benchmark(
        "report",
        "bench_report.py",
        summary=lambda r: (
            f"median {r['median_us']} us (SimpleQueue.put {r['baseline_median_us']} us)",
            f"<= {r['goal_median_us']} us",
        ),
    ),
    Benchmark(
        "ingest",
        "bench_ingest.py",
        quick_args=("--repeat", "1"),
        summary=lambda r: (
            f"API {r['api_points_per_second']:,} pts/s = {r['ratio']} x COPY",
            f">= {r['goal_api_points_per_second']:,} pts/s, >= {r['goal_ratio']} x",
        ),
    ),
    Benchmark(
        "throughput",
        "bench_ddp_throughput.py",
        quick_args=("--repeat", "2"),
        summary=lambda r: (
            f"{r['ratio']} x torchrun ({r['phalanx_steps_per_second']} vs {r['plain_steps_per_second']} steps/s)",
            f">= {r['goal_ratio']} x",
        ),
    ),
    Benchmark(
        "integrations",
        "bench_integrations.py",
        quick_args=("--repeat", "1"),
        summary=lambda r: (
            "; ".join(f"{row['workload']} {row['ratio']} x" for row in r["rows"]),
            f">= {r['goal_ratio']} x plain torchrun, each",
        ),
    ),
    Benchmark("start_latency", "bench_start_latency.py", quick_args=("--repeat", "2"), summary=_latency_summary),
    Benchmark(
        "checkpoint",
        "bench_checkpoint.py",
        quick_args=("--repeat", "6"),
        summary=lambda r: (
            f"x{r['throughput_ratio']} of torch.save; loop blocked x{r['blocked_vs_plain']}",
            f">= x{r['goal_throughput_ratio']}; blocked <= plain",
        ),
    ),
    Benchmark(
        "recovery",
        "bench_recovery.py",
        quick_args=("--repeat", "1"),
        summary=lambda r: (
            f"worker kill x{r['ratio']} of torchrun ({r['worker_kill_phalanx_s']} s vs "
            f"{r['worker_kill_torchrun_s']} s); agent kill {r['agent_kill_s']} s",
            f"<= x{r['goal_ratio']}; <= {r['goal_agent_kill_s']} s",
        ),
    ),
    Benchmark(
        "study",
        "bench_study.py",
        quick_args=("--skip-efficiency",),
        summary=lambda r: (
            f"x{r['ratio']} of study.optimize ({r['phalanx_wall_s']} s vs {r['optuna_wall_s']} s); "
            f"ask -> RUNNING +{r['ask_to_running_added_s']} s over a job start",
            f"<= x{r['goal_ratio']}; <= +{r['goal_added_s']} s",
        ),
    ),
    Benchmark(
        "dashboard",
        "bench_dashboard.py",
        quick_args=("--repeat", "5", "--loads", "2"),
        summary=lambda r: (
            f"chart data {r['chart_data_server_ms']} ms (x{r['chart_vs_raw']} of the raw read); "
            f"load -> chart drawn {r['browser_load_to_chart_ms']} ms",
            f"<= {r['goal_server_ms']} ms; <= {r['goal_browser_ms']} ms",
        ),
    ),
)
NAMES = tuple(b.name for b in BENCHMARKS)


def run_one(bench: Benchmark, quick: bool) -> Result:
    argv = [sys.executable, str(BENCH_DIR / bench.script), *(bench.quick_args if quick else bench.args)]
    print(f"== {bench.name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    # stderr (progress) goes straight to the terminal; stdout holds the one JSON line.
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result: Result
    if lines:
        result = json.loads(lines[-1])
    else:
        result = {"bench": bench.name, "ok": False, "error": f"exited with {done.returncode} and printed no JSON"}
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _stack_failures(result: Result) -> int:
    """How many times a stack broke mid-measurement (top level or per backend)."""
    found = result.get("stack_failures")
    count = len(found) if isinstance(found, list) else 0
    for value in result.values():
        if isinstance(value, dict) and isinstance(value.get("stack_failures"), list):
            count += len(value["stack_failures"])
    return count


def summary_table(results: list[tuple[Benchmark, Result]]) -> str:
    rows = [("benchmark", "figure", "goal", "ok")]
    for bench, result in results:
        try:
            figure, goal = bench.summary(result) if "error" not in result else (str(result["error"]), "")
        except (KeyError, TypeError, ValueError) as exc:
            figure, goal = f"unreadable result ({exc!r})", ""
        failures = _stack_failures(result)
        if failures:
            figure += f" [{failures} stack failure(s), see stack_failures]"
        rows.append((bench.name, figure, goal, "yes" if result.get("ok") else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", nargs="+", choices=NAMES, default=[], help="benchmarks not to run")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=[], help="run just these")
    parser.add_argument("--quick", action="store_true", help="fewer repeats of the slow ones (noisier figures)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results.jsonl")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if b.name not in args.skip and (not args.only or b.name in args.only)]

    results: list[tuple[Benchmark, Result]] = []
    with args.out.open("w") as out:
        for bench in chosen:
            result = run_one(bench, args.quick)
            line = json.dumps(result)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()
            results.append((bench, result))
    print(summary_table(results))
    print(f"results written to {args.out}", file=sys.stderr)
    return 0 if all(result.get("ok") for _, result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
