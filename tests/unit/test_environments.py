"""Runtime environments on one node: real uv, offline from a wheelhouse of wheels the tests make."""

from __future__ import annotations

import sys
import sysconfig
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from phalanx.schemas import JobSpec, RuntimeEnv
from tests.wheels import make_wheel
from worker_agent.environments import (
    EnvironmentFailed,
    Environments,
    EnvironmentsConfig,
    Interpreter,
    PackageIndex,
    parse_lock,
)

BASE = {"phx-base": "2.0"}  # what the "agent's interpreter" has, as far as these tests go


@pytest.fixture
def wheelhouse(tmp_path: Path) -> Path:
    house = tmp_path / "wheelhouse"
    house.mkdir()
    make_wheel(house, "phx-probe", "1.0", "VERSION = '1.0'\n", requires=("phx-base>=1",))
    make_wheel(house, "phx-probe", "1.1", "VERSION = '1.1'\n", requires=("phx-base>=1",))
    make_wheel(house, "phx-base", "1.0", "")
    make_wheel(house, "phx-base", "2.0", "")
    make_wheel(house, "phx-extra", "3.0", "")
    return house


def environments(tmp_path: Path, wheelhouse: Path, **config: float) -> Environments:
    interpreter = Interpreter(sys.executable, sys.version.split()[0], sysconfig.get_platform(), dict(BASE))
    return Environments(
        EnvironmentsConfig(root=tmp_path / "envs", wheelhouse=wheelhouse, **config),  # type: ignore[arg-type]
        interpreter=interpreter,
        index=PackageIndex(),
    )


def test_pip_configuration_is_read_as_pip_install_reads_it() -> None:
    listing = "\n".join(
        [
            "global.index-url='https://mirror.example/simple'",
            "install.index-url='https://install.example/simple'",
            "global.extra-index-url='file:///a/simple file:///b/simple'",
            "global.find-links='/opt/wheels'",
            ":env:.find-links='/srv/wheels /srv/more'",
            "global.constraint='/etc/pip/constraints.txt'",
            "global.cert='/etc/ssl/ca.pem'",
            "global.trusted-host='mirror.example'",
            "not a config line",
        ]
    )
    index = PackageIndex.parse(listing)
    assert index.index_url == "https://install.example/simple"  # [install] over [global]
    assert index.extra_index_urls == ("file:///a/simple", "file:///b/simple")
    assert index.find_links == ("/srv/wheels", "/srv/more")  # PIP_FIND_LINKS over the files
    assert index.constraints == ("/etc/pip/constraints.txt",)
    assert index.uv_env() == {"SSL_CERT_FILE": "/etc/ssl/ca.pem"}
    args = index.uv_args(None)
    assert args[:2] == ["--index-strategy", "unsafe-best-match"]  # pip's way: the best of all indexes
    assert "--index-url" in args and "--allow-insecure-host" in args and "--offline" not in args
    offline = index.uv_args(Path("/wheels"))
    assert "--offline" in offline and "--no-index" in offline and "--index-url" not in offline
    assert offline[offline.index("--offline") + 2] == "/wheels"


def test_a_lock_pins_every_package_with_its_hash(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    lock = envs.resolve(["phx-probe"], lambda _: None)
    entries = {e.name: e for e in parse_lock(lock)}
    assert {name: e.version for name, e in entries.items()} == {"phx-probe": "1.1", "phx-base": "2.0"}
    assert all("--hash=sha256:" in e.text for e in entries.values())


def test_only_what_the_interpreter_lacks_is_installed(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    lock = envs.resolve(["phx-probe==1.0"], lambda _: None)
    environment = envs.acquire(lock, lambda _: None)
    try:
        installed = {p.name for p in environment.site.iterdir() if not p.name.startswith(".")}
        assert installed == {"phx_probe", "phx_probe-1.0.dist-info"}  # phx-base is the interpreter's
        assert (environment.site / "phx_probe" / "__init__.py").read_text() == "VERSION = '1.0'\n"
        env = environment.rank_env({"PYTHONPATH": "/mine", "PATH": "/bin"})
        assert env["PYTHONPATH"] == f"{environment.site}:/mine"
    finally:
        environment.release()


def test_a_requirement_that_would_replace_a_base_package_names_both(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    with pytest.raises(EnvironmentFailed) as failed:
        envs.resolve(["phx-base==1.0"], lambda _: None)
    assert "phx-base==1.0" in str(failed.value) and "phx-base 2.0" in str(failed.value)


def test_a_missing_package_is_named(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    with pytest.raises(EnvironmentFailed, match="phx-nowhere"):
        envs.resolve(["phx-nowhere==1.0"], lambda _: None)
    assert not list((tmp_path / "envs").glob(".resolve-*"))


def test_a_lock_made_for_other_base_packages_is_refused(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    lock = envs.resolve(["phx-probe"], lambda _: None).replace("phx-base==2.0", "phx-base==1.0")
    with pytest.raises(EnvironmentFailed, match=r"pins phx-base==1.0, but this agent's interpreter has phx-base 2.0"):
        envs.acquire(lock, lambda _: None)


def test_two_nodes_needing_one_environment_at_once_build_it_once(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    lock = envs.resolve(["phx-probe", "phx-extra"], lambda _: None)
    lines: list[str] = []
    start = threading.Barrier(4)
    held = []

    def node() -> None:
        start.wait()
        held.append(envs.acquire(lock, lines.append))

    threads = [threading.Thread(target=node) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(line.startswith("building environment") for line in lines) == 1, lines
    assert sum("is built on this node" in line for line in lines) == 4  # the builder too, once built
    assert len({e.site for e in held}) == 1
    for environment in held:
        environment.release()


def test_a_changed_pin_is_a_new_environment(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    old = envs.acquire(envs.resolve(["phx-probe==1.0"], lambda _: None), lambda _: None)
    new = envs.acquire(envs.resolve(["phx-probe==1.1"], lambda _: None), lambda _: None)
    assert old.key != new.key
    assert (new.site / "phx_probe" / "__init__.py").read_text() == "VERSION = '1.1'\n"
    assert (old.site / "phx_probe" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    old.release()
    new.release()


def test_the_key_covers_the_packages_and_the_interpreter_not_the_comments() -> None:
    lock = "six==1.16.0 \\\n    --hash=sha256:aa\n"
    one = Interpreter("python", "3.11.7", "linux-x86_64", {"torch": "2.13.0"})
    assert one.key(lock) != Interpreter("python", "3.12.1", "linux-x86_64", {"torch": "2.13.0"}).key(lock)
    assert one.key(lock) != Interpreter("python", "3.11.7", "linux-x86_64", {"torch": "2.14.1"}).key(lock)
    assert one.key(lock) != one.key(lock.replace("aa", "bb"))
    assert one.key(lock) != one.key(lock.replace("1.16.0", "1.17.0"))
    assert one.key(lock) == one.key("# resolved from /tmp/x/requirements.in\n" + lock + "    # via -r /tmp/y\n")
    assert one.key(lock) == Interpreter("other", "3.11.7", "linux-x86_64", {"torch": "2.13.0"}).key(lock)


def test_what_a_crashed_build_left_is_removed_and_built_again(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    lock = envs.resolve(["phx-extra"], lambda _: None)
    key = envs.interpreter.key(lock)
    crashed = tmp_path / "envs" / f".build-{key}-dead"
    (crashed / "site" / "phx_extra").mkdir(parents=True)  # half-made: no lock.txt, never renamed
    environment = envs.acquire(lock, lambda _: None)
    environment.release()
    assert not crashed.exists() and (tmp_path / "envs" / key / "lock.txt").read_text() == lock


def test_collection_drops_the_least_recently_used_but_never_one_in_use(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse, size_budget=0)
    in_use = envs.acquire(envs.resolve(["phx-probe==1.0"], lambda _: None), lambda _: None)
    unused = envs.acquire(envs.resolve(["phx-extra"], lambda _: None), lambda _: None)
    unused.release()
    envs.collect()
    assert in_use.site.is_dir() and not unused.site.exists()
    in_use.release()
    envs.prepare()
    assert not in_use.site.exists()


def test_a_build_past_its_timeout_is_stopped(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse, build_timeout=0.0)
    with pytest.raises(EnvironmentFailed, match="longer than 0 s"):
        envs.resolve(["phx-probe"], lambda _: None)


def test_a_requirements_file_is_read_line_by_line(tmp_path: Path, wheelhouse: Path) -> None:
    envs = environments(tmp_path, wheelhouse)
    workdir = tmp_path / "code"
    workdir.mkdir()
    (workdir / "requirements.txt").write_text("# pinned\nphx-probe==1.0  # the probe\n\nphx-extra\n")
    spec = RuntimeEnv(pip=["phx-base>=1"], requirements="requirements.txt")
    assert envs.requirements(spec, workdir) == ["phx-base>=1", "phx-probe==1.0", "phx-extra"]
    (workdir / "requirements.txt").write_text("phx-probe\n--index-url http://elsewhere/simple\n")
    with pytest.raises(EnvironmentFailed, match=r"requirements\.txt, line 2"):
        envs.requirements(spec, workdir)
    (workdir / "requirements.txt").unlink()
    (workdir / "requirements.txt").symlink_to(tmp_path / "outside.txt")
    (tmp_path / "outside.txt").write_text("phx-probe\n")
    with pytest.raises(EnvironmentFailed, match="not a file in the job's workdir"):
        envs.requirements(spec, workdir)


@pytest.mark.parametrize(
    "requirement",
    ["phx @ https://example.com/phx.whl", "--index-url http://x", "./local/path", "-e .", "", "a b", "x==1\ny"],
)
def test_the_spec_refuses_what_is_not_a_plain_requirement(requirement: str) -> None:
    with pytest.raises(ValidationError, match="not a requirement this platform installs"):
        JobSpec(name="j", entrypoint="python t.py", runtime_env={"pip": [requirement]})


@pytest.mark.parametrize("path", ["/etc/passwd", "../up.txt", "a/../../b"])
def test_the_spec_refuses_a_requirements_file_outside_the_workdir(path: str) -> None:
    with pytest.raises(ValidationError, match="inside the workdir"):
        RuntimeEnv(requirements=path)


def test_an_empty_runtime_env_says_what_it_needs() -> None:
    with pytest.raises(ValidationError, match="needs `pip`"):
        RuntimeEnv()
