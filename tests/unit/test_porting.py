"""What porting a plain script to Phalanx costs, and that the port still runs without Phalanx."""

from __future__ import annotations

import ast
import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_train_api import subprocess_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def added_lines(plain: Path, port: Path) -> list[str]:
    """Lines of the port that the plain script lacks, its docstring and blank lines not counted."""

    def code(path: Path) -> list[str]:
        source = path.read_text()
        docstring = ast.get_docstring(ast.parse(source), clean=False) or ""
        lines = source.replace(f'"""{docstring}"""', "", 1).splitlines()
        return [line for line in lines if line.strip()]

    diff = difflib.unified_diff(code(plain), code(port), lineterm="", n=0)
    return [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]


@pytest.mark.parametrize(("example", "most"), [("resumable", 10), ("lightning", 3), ("hf_trainer", 5)])
def test_the_port_changes_at_most_so_many_lines(example: str, most: int) -> None:
    added = added_lines(EXAMPLES / example / "train_plain.py", EXAMPLES / example / "train.py")
    assert len(added) <= most, "\n".join(added)


def test_the_resumable_port_reproduces_its_plain_twin_and_resumes_exactly(tmp_path: Path) -> None:
    def checksum(script: str, *args: str, **env: str) -> str:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "resumable" / script), *args],
            cwd=tmp_path,
            env=subprocess_env(**env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.rsplit("final-checksum: ", 1)[1].strip()

    uninterrupted = checksum("train_plain.py", "--epochs", "4")
    (tmp_path / "checkpoint.pt").unlink()
    checksum("train_plain.py", "--epochs", "2")
    assert checksum("train_plain.py", "--epochs", "4") == uninterrupted  # the twin resumes exactly
    assert checksum("train.py", "--epochs", "4", PHALANX_CHECKPOINT_ROOT=f"file://{tmp_path}/px") == uninterrupted
