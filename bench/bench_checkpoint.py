"""Checkpoint save through Phalanx vs. a plain torch.save of the same 100 MB state dict, same disk.

Phalanx writes the files under a temporary name on the training thread, then renames them into
place (and commits) on a background thread. Reported: how long the training loop is blocked,
and the end-to-end time until the checkpoint is in place, each against the plain save.

    python bench/bench_checkpoint.py [--mb 100] [--repeat 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.train._checkpoint import CheckpointWriter


def run(mb: int = 100, repeat: int = 16) -> dict[str, object]:
    state = {"weights": torch.randn(mb * 2**18), "step": 1}  # float32: 4 bytes per element
    plain, blocked, total = [], [], []
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as scratch:
        root = Path(scratch)
        writer = CheckpointWriter(f"file://{root / 'phalanx'}", 0, 0, 1, None, lambda: None)

        def plain_save(i: int) -> None:
            os.sync()  # each save starts with no dirty pages of the previous one pending
            start = time.perf_counter()
            torch.save(state, root / f"plain-{i}.pt")
            plain.append(time.perf_counter() - start)

        def phalanx_save(i: int) -> None:
            os.sync()
            start = time.perf_counter()
            writer.save(state, step=i, metrics=None, sharded=False)
            blocked.append(time.perf_counter() - start)
            assert writer.flush(120)
            total.append(time.perf_counter() - start)

        for i in range(repeat):  # interleaved, alternating which goes first: drift hits both alike
            first, second = (plain_save, phalanx_save) if i % 2 == 0 else (phalanx_save, plain_save)
            first(i)
            second(i)
            (root / f"plain-{i}.pt").unlink()
            shutil.rmtree(root / "phalanx", ignore_errors=True)
        writer.close(5)
    plain_s, blocked_s, total_s = (statistics.median(v) for v in (plain, blocked, total))
    throughput_ratio = plain_s / total_s
    return {
        "bench": "checkpoint",
        "mb": mb,
        "plain_save_s": round(plain_s, 4),
        "phalanx_blocked_s": round(blocked_s, 4),
        "phalanx_total_s": round(total_s, 4),
        "throughput_ratio": round(throughput_ratio, 3),
        "blocked_vs_plain": round(blocked_s / plain_s, 3),
        "goal_throughput_ratio": 0.9,
        # the loop must be blocked no longer than the plain save (5% for timer noise)
        "ok": throughput_ratio >= 0.9 and blocked_s <= plain_s * 1.05,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=16)
    args = parser.parse_args()
    result = run(args.mb, args.repeat)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
