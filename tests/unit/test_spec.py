"""Job files: what validates, and what each mistake is called."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from phalanx.client import SpecError, load_job_file, pack_workdir
from phalanx.schemas import JobSpec, Precision, SlotType

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "job.yaml"


def test_example_job_file_validates() -> None:
    spec, workdir = load_job_file(EXAMPLE)
    assert spec.resources.nodes == 2 and spec.resources.slots_per_node == 1
    assert spec.resources.slot_type is SlotType.CPU
    assert workdir == EXAMPLE.parent
    assert (workdir / "train.py").exists()


def test_defaults() -> None:
    spec = JobSpec(name="tiny", entrypoint="python x.py")
    assert spec.resources.world_size == 1
    assert spec.precision is Precision.FP32
    assert spec.priority == 50 and spec.max_restarts == 0


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"name": "bad name!"}, "name"),
        ({"entrypoint": "   "}, "entrypoint"),
        ({"resources": {"nodes": 0}}, "resources.nodes"),
        ({"resources": {"slot_type": "tpu"}}, "resources.slot_type"),
        ({"precision": "fp8"}, "precision"),
        ({"priority": 101}, "priority"),
        ({"env": {"PHALANX_URL": "x"}}, "env"),
        ({"env": {"1BAD": "x"}}, "env"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_invalid_specs_name_the_field(patch: dict[str, object], field: str) -> None:
    raw: dict[str, object] = {"name": "ok", "entrypoint": "python x.py", **patch}
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(raw)
    locations = {".".join(map(str, e["loc"])) for e in info.value.errors()}
    assert field in locations


@pytest.mark.parametrize(
    ("patch", "problem"),
    [
        ({"env": {f"V{i}": "x" for i in range(257)}}, "at most 256 items"),
        ({"env": {"V" * 129: "x"}}, "at most 128 characters"),
        ({"env": {"V": "x" * 16_385}}, "at most 16384 characters"),
        ({"env": {f"V{i}": "x" * 16_000 for i in range(5)}}, "above the limit of 65,536"),
        ({"hyperparameters": {f"h{i}": 1 for i in range(257)}}, "at most 256 items"),
        ({"hyperparameters": {"h" * 129: 1}}, "at most 128 characters"),
        ({"hyperparameters": {"lr": float("nan")}}, "lr: NaN and Infinity are not allowed"),
        ({"hyperparameters": {"grid": [1.0, float("inf")]}}, "grid: NaN and Infinity are not allowed"),
        ({"hyperparameters": {"text": "x" * 16_400}}, "above the limit of 16,384"),
        ({"hyperparameters": {f"h{i}": "x" * 16_000 for i in range(5)}}, "PHALANX_HPARAMS), above the limit of 65,536"),
        ({"workdir": "w" * 4097}, "at most 4096 characters"),
        ({"checkpoint": {"keep_last": 1001}}, "less than or equal to 1000"),
        ({"checkpoint": {"keep_best": 1, "metric": "m" * 129}}, "at most 128 characters"),
        ({"checkpoint": {"storage": "file:///" + "s" * 4096}}, "at most 4096 characters"),
        ({"hang_timeout": float("inf")}, "finite number"),
    ],
)
def test_every_string_count_and_number_is_bounded(patch: dict[str, object], problem: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"name": "ok", "entrypoint": "python x.py", **patch})
    assert problem in str(info.value)


def test_a_spec_at_its_bounds_validates() -> None:
    JobSpec.model_validate(
        {
            "name": "ok",
            "entrypoint": "python x.py",
            "env": {f"V{i}": "x" * 250 for i in range(256)},
            "hyperparameters": {f"h{i}": "x" * 240 for i in range(256)},
        }
    )


def test_job_file_errors(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job_file(bad_yaml)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_job_file(not_mapping)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"name": "x", "entrypoint": "python a.py", "resources": {"nodes": -1}}))
    with pytest.raises(SpecError, match=r"resources\.nodes"):
        load_job_file(wrong)
    with pytest.raises(SpecError, match="cannot read"):
        load_job_file(tmp_path / "missing.yaml")


def test_bundle_excludes_caches_and_is_capped(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"0" * 10)
    with tarfile.open(fileobj=io.BytesIO(pack_workdir(tmp_path))) as tar:
        names = tar.getnames()
    assert "./train.py" in names and not any("__pycache__" in n for n in names)
    (tmp_path / "big.bin").write_bytes(os.urandom(200_000))
    with pytest.raises(SpecError, match="over the"):
        pack_workdir(tmp_path, max_bytes=100_000)
