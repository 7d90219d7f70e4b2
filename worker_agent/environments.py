"""Runtime environments: a job's Python packages, resolved once into a lock, installed on each node.

Resolution (`Environments.resolve`, on node rank 0 of the job's first attempt): `uv pip compile
--generate-hashes` for this interpreter, with every package the agent's interpreter has (torch and
Phalanx above all) pinned as a constraint. The lock goes to the server, and every node of every
attempt installs that same lock (`Environments.acquire`).

Installation: only the lock's packages the interpreter lacks, `--no-deps --require-hashes`, into
`<root>/<key>/site`, which the ranks get on `PYTHONPATH` (ahead of site-packages). A venv with
`--system-site-packages` would not do: made from the agent's venv interpreter, it sees the *base*
interpreter's packages, not the agent venv's torch. The base packages are never installed, so a job
cannot replace them; one that asks for another version of one fails to resolve, naming both.

The key is a digest of the lock, the interpreter's version and platform and its installed packages,
so a changed pin, a new torch or another Python builds a new environment, and nothing is reused
because its requirement text looked the same.

On disk, under `<root>` (the agent's `envs/`):
    <key>/site/, <key>/lock.txt   a complete environment (renamed into place only when complete)
    <key>.lock                    flock: shared while a node uses it, exclusive to delete it
    <key>.build                   flock: held while building it (the other nodes wait for it)
    .build-<key>-<nonce>/         a build in progress; whatever a crash leaves is removed later
    .uv-cache/                    uv's download and wheel cache: same filesystem (hardlinks), kept

The node's package configuration is pip's (`pip config list`: index-url, extra-index-url,
find-links, constraint, cert, trusted-host, no-index), passed to uv as its own options, since uv
does not read pip.conf. uv's own settings (`UV_*`, uv.toml) apply as well. With a wheelhouse
(`--wheelhouse`), uv runs offline from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from phalanx.schemas import RuntimeEnv, check_requirement

log = logging.getLogger("phalanx.agent")
MAX_REQUIREMENTS_FILE_BYTES = 256 * 1024
# uv's error lines that explain a failure come last; this many are kept for the job's failure reason.
REASON_LINES = 12


class EnvironmentFailed(Exception):
    """The environment cannot be resolved or built; the message (uv's own, mostly) names why."""


@dataclass(frozen=True)
class PackageIndex:
    """Where packages come from on this node, as pip on it would read its configuration."""

    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    cert: str | None = None
    trusted_hosts: tuple[str, ...] = ()
    no_index: bool = False

    @classmethod
    def parse(cls, listing: str) -> PackageIndex:
        """From `pip config list` output (`section.key='value'` lines, `:env:` for PIP_* variables).

        The environment overrides the files, and the `install` section overrides `global`, as for
        `pip install`. A multi-valued option is one value separated by whitespace."""
        rank = {":env:": 3, "install": 2, "global": 1}
        best: dict[str, tuple[int, str]] = {}
        for line in listing.splitlines():
            match = re.match(r"^([^.=]+)\.([A-Za-z0-9_-]+)='(.*)'$", line.strip())
            if match is None:
                continue
            section, key, value = match.groups()
            key = key.replace("_", "-")
            if section not in rank:
                continue
            if key not in best or rank[section] >= best[key][0]:
                best[key] = (rank[section], value)

        def many(key: str) -> tuple[str, ...]:
            return tuple(best[key][1].split()) if key in best else ()

        def one(key: str) -> str | None:
            return best[key][1] if key in best and best[key][1] else None

        return cls(
            index_url=one("index-url"),
            extra_index_urls=many("extra-index-url"),
            find_links=many("find-links"),
            constraints=many("constraint"),
            cert=one("cert"),
            trusted_hosts=many("trusted-host"),
            no_index=(one("no-index") or "").lower() in ("1", "true", "yes", "on"),
        )

    @classmethod
    def from_pip(cls, python: str = sys.executable) -> PackageIndex:
        """This node's pip configuration; none when pip is missing or fails."""
        try:
            out = subprocess.run(
                [python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return cls()
        return cls.parse(out.stdout) if out.returncode == 0 else cls()

    def uv_args(self, wheelhouse: Path | None) -> list[str]:
        # pip takes the best version from all its indexes together; uv by default only looks at the
        # first index that has a package. Installing as pip on this node would means pip's way.
        args: list[str] = ["--index-strategy", "unsafe-best-match"]
        offline = wheelhouse is not None or self.no_index
        if offline:
            args.append("--no-index")
        else:
            if self.index_url:
                args += ["--index-url", self.index_url]
            for url in self.extra_index_urls:
                args += ["--extra-index-url", url]
        if wheelhouse is not None:
            args += ["--offline", "--find-links", str(wheelhouse)]
        for link in self.find_links:
            args += ["--find-links", link]
        for host in self.trusted_hosts:
            args += ["--allow-insecure-host", host]
        return args

    def uv_env(self) -> dict[str, str]:
        return {"SSL_CERT_FILE": self.cert} if self.cert else {}


@dataclass(frozen=True)
class Interpreter:
    """The agent's interpreter, which every rank runs on: its packages are the environments' base."""

    python: str
    version: str
    platform: str
    packages: dict[str, str]  # canonical name -> version, as installed

    @classmethod
    def current(cls) -> Interpreter:
        packages: dict[str, str] = {}
        for dist in importlib.metadata.distributions():
            name = dist.metadata["Name"]
            if name:
                packages.setdefault(canonicalize_name(name), dist.version)
        return cls(sys.executable, sys.version.split()[0], sysconfig.get_platform(), packages)

    def constraints(self) -> str:
        return "".join(f"{name}=={version}\n" for name, version in sorted(self.packages.items()))

    def key(self, lock: str) -> str:
        """What an environment built from `lock` for this interpreter is named: the lock's packages
        and hashes count, its comments and layout do not."""
        packages = "\n".join(sorted(entry.text for entry in parse_lock(lock)))
        digest = hashlib.sha256()
        for part in (packages, self.version, self.platform, self.constraints()):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()[:32]


@dataclass(frozen=True)
class LockEntry:
    name: str  # canonical
    version: str
    text: str  # the requirement line with its hashes, as the lock has it


def parse_lock(lock: str) -> list[LockEntry]:
    """The packages of a `uv pip compile --generate-hashes` output (comments dropped)."""
    entries: list[LockEntry] = []
    block: list[str] = []

    def close() -> None:
        if not block:
            return
        text = " ".join(part.rstrip("\\").strip() for part in block)
        head = text.split()[0]
        try:
            requirement = Requirement(head)
        except InvalidRequirement as exc:
            raise EnvironmentFailed(f"the lock has a line that is not a requirement: {head!r}") from exc
        pins = [s.version for s in requirement.specifier if s.operator == "=="]
        if len(pins) != 1:
            raise EnvironmentFailed(f"the lock does not pin {requirement.name} to one version: {head!r}")
        entries.append(LockEntry(canonicalize_name(requirement.name), pins[0], text))
        block.clear()

    for raw in lock.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if line[0].isspace():  # a continuation: its hashes
            if block:
                block.append(line)
            continue
        close()
        block.append(line)
    close()
    return entries


@dataclass
class EnvironmentsConfig:
    root: Path
    wheelhouse: Path | None = None
    build_timeout: float = 900.0  # seconds for resolving and installing, together
    size_budget: int = 20 * 1024**3  # bytes of built environments kept; least recently used go first
    allow_source_builds: bool = False  # building an sdist runs its code as the agent's user


class Environment:
    """A complete environment in use by one node: its shared lock is held until `release()`."""

    def __init__(self, key: str, path: Path, guard: int) -> None:
        self.key = key
        self.site = path / "site"
        self._guard = guard

    def rank_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the environment's packages importable and its scripts on PATH."""
        out = dict(env)
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.site), env.get("PYTHONPATH", "")) if p)
        scripts = self.site / "bin"
        if scripts.is_dir():
            out["PATH"] = os.pathsep.join(p for p in (str(scripts), env.get("PATH", "")) if p)
        return out

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._guard)


class Environments:
    """Resolves requirements into locks and builds the environments of this agent's nodes.

    The interpreter's packages and pip's configuration are read on first use (`pip config list`
    takes ~0.5 s), or ahead of it by `sweep()`."""

    def __init__(
        self, config: EnvironmentsConfig, interpreter: Interpreter | None = None, index: PackageIndex | None = None
    ) -> None:
        self.config = config
        self._interpreter = interpreter
        self._index = index
        self._gc_lock = threading.Lock()
        self._read_lock = threading.Lock()

    @property
    def interpreter(self) -> Interpreter:
        with self._read_lock:
            if self._interpreter is None:
                self._interpreter = Interpreter.current()
            return self._interpreter

    @property
    def index(self) -> PackageIndex:
        with self._read_lock:
            if self._index is None:
                self._index = PackageIndex.from_pip(self.interpreter_python())
            return self._index

    def interpreter_python(self) -> str:
        return self._interpreter.python if self._interpreter is not None else sys.executable

    @property
    def root(self) -> Path:
        return self.config.root

    # --- requirements and resolution ---------------------------------------------------------

    def requirements(self, spec: RuntimeEnv, workdir: Path) -> list[str]:
        """The job's requirements: `pip`, then the lines of `requirements` (read from the workdir)."""
        wanted = list(spec.pip)
        if spec.requirements is not None:
            path = (workdir / spec.requirements).resolve()
            if not path.is_relative_to(workdir.resolve()) or not path.is_file():
                raise EnvironmentFailed(
                    f"runtime_env.requirements: {spec.requirements} is not a file in the job's workdir"
                )
            if path.stat().st_size > MAX_REQUIREMENTS_FILE_BYTES:
                raise EnvironmentFailed(
                    f"runtime_env.requirements: {spec.requirements} is larger than "
                    f"{MAX_REQUIREMENTS_FILE_BYTES:,} bytes"
                )
            for number, raw in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
                if not line:
                    continue
                try:
                    wanted.append(check_requirement(line))
                except ValueError as exc:
                    raise EnvironmentFailed(f"{spec.requirements}, line {number}: {exc}") from None
        return wanted

    def resolve(self, wanted: list[str], on_line: Callable[[str], None]) -> str:
        """The lock for `wanted` on this interpreter, its packages pinned; EnvironmentFailed naming why."""
        self.root.mkdir(parents=True, exist_ok=True)
        scratch = self.root / f".resolve-{secrets.token_hex(6)}"
        scratch.mkdir()
        try:
            (scratch / "requirements.in").write_text("".join(f"{line}\n" for line in wanted))
            (scratch / "base.txt").write_text(self.interpreter.constraints())
            args = ["pip", "compile", str(scratch / "requirements.in"), "--generate-hashes"]
            args += ["--no-header", "--no-annotate"]
            args += ["--constraint", str(scratch / "base.txt")]
            args += [arg for path in self.index.constraints for arg in ("--constraint", path)]
            on_line(f"resolving {len(wanted)} requirement(s) against this interpreter's packages")
            out = self._uv(args, on_line, deadline=time.monotonic() + self.config.build_timeout, keep_stdout=True)
        except EnvironmentFailed as exc:
            raise EnvironmentFailed(self._explain(str(exc), wanted)) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return out

    def _explain(self, message: str, wanted: list[str]) -> str:
        """uv's message, plus which of the job's requirements the agents' own packages pin."""
        pinned = []
        for line in wanted:
            with contextlib.suppress(InvalidRequirement):
                name = canonicalize_name(Requirement(line).name)
                if name in self.interpreter.packages:
                    pinned.append(f"{name} {self.interpreter.packages[name]}")
        if not pinned:
            return message
        return (
            f"{message}\n(the agents' interpreter has {', '.join(pinned)}: its own packages are fixed, and an "
            "environment cannot replace them)"
        )

    # --- building and using -----------------------------------------------------------------

    def acquire(self, lock: str, on_line: Callable[[str], None]) -> Environment:
        """The environment of `lock`, built first if this node has none; held until released."""
        entries = parse_lock(lock)
        missing = self._to_install(entries)
        key = self.interpreter.key(lock)
        final = self.root / key
        self.root.mkdir(parents=True, exist_ok=True)
        guard = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                fcntl.flock(guard, fcntl.LOCK_SH)
                if (final / "lock.txt").is_file():
                    os.utime(final / "lock.txt")  # last use, for collection
                    on_line(f"environment {key[:12]} is built on this node; using it")
                    return Environment(key, final, guard)
                # Not under the shared lock: a builder waiting for it would wait for every node
                # that uses the environment to end. Builds have a lock of their own.
                fcntl.flock(guard, fcntl.LOCK_UN)
                self._build_once(key, lock, missing, on_line)
        except BaseException:
            os.close(guard)
            raise

    def _build_once(self, key: str, lock: str, missing: list[LockEntry], on_line: Callable[[str], None]) -> None:
        """Build `key` unless it is built; one build per key on this node, the others wait for it."""
        builder = os.open(self.root / f"{key}.build", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(builder, fcntl.LOCK_EX)
            if not (self.root / key / "lock.txt").is_file():
                self._build(key, lock, missing, on_line)
        finally:
            os.close(builder)

    def _to_install(self, entries: list[LockEntry]) -> list[LockEntry]:
        """The lock's packages the interpreter lacks; EnvironmentFailed if it pins a base one otherwise."""
        missing = []
        for entry in entries:
            have = self.interpreter.packages.get(entry.name)
            if have is None:
                missing.append(entry)
            elif have != entry.version:
                raise EnvironmentFailed(
                    f"the job's lock pins {entry.name}=={entry.version}, but this agent's interpreter has "
                    f"{entry.name} {have}: the job's nodes must run agents with the same packages"
                )
        return missing

    def _build(self, key: str, lock: str, missing: list[LockEntry], on_line: Callable[[str], None]) -> None:
        """Install `missing` into a new folder, renamed to `<key>` once complete. Holds `<key>.build`."""
        for stale in self.root.glob(f".build-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a crashed build's (we hold its build lock)
        build = self.root / f".build-{key}-{secrets.token_hex(6)}"
        (build / "site").mkdir(parents=True)
        started = time.monotonic()
        try:
            if missing:
                (build / "install.txt").write_text("".join(f"{entry.text}\n" for entry in missing))
                on_line(f"building environment {key[:12]}: installing {len(missing)} package(s)")
                args = ["pip", "install", "--target", str(build / "site"), "--no-deps", "--require-hashes"]
                args += ["-r", str(build / "install.txt")]
                self._uv(args, on_line, deadline=started + self.config.build_timeout)
            (build / "lock.txt").write_text(lock)
            os.rename(build, self.root / key)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        on_line(f"environment {key[:12]} built in {time.monotonic() - started:.1f} s")
        threading.Thread(target=self.collect, name="env-gc", daemon=True).start()

    def _uv(self, args: list[str], on_line: Callable[[str], None], deadline: float, keep_stdout: bool = False) -> str:
        """Run uv, its stderr (and stdout, unless kept) to `on_line`; its stdout if kept."""
        from uv import find_uv_bin

        command = [find_uv_bin(), *args, "--python", self.interpreter.python]
        command += self.index.uv_args(self.config.wheelhouse)
        if not self.config.allow_source_builds:
            command.append("--no-build")
        env = {
            **os.environ,
            **self.index.uv_env(),
            "UV_CACHE_DIR": str(self.root / ".uv-cache"),
            "NO_COLOR": "1",
            "UV_NO_PROGRESS": "1",
        }
        env = {k: v for k, v in env.items() if not k.startswith("PHALANX_")}
        tail: list[str] = []
        kept: list[str] = []
        with subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a timeout stops uv and whatever it started
        ) as proc:

            def pump_stderr() -> None:
                assert proc.stderr is not None
                for line in proc.stderr:
                    text = line.rstrip("\n")
                    on_line(text)
                    tail.append(text)
                    del tail[:-REASON_LINES]

            pump = threading.Thread(target=pump_stderr, daemon=True)
            pump.start()
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), _kill_tree, args=(proc,))
            timer.daemon = True
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if keep_stdout:
                        kept.append(line)
                    else:
                        on_line(line.rstrip("\n"))
                code = proc.wait()
            finally:
                timer.cancel()
            pump.join(timeout=10)
        if time.monotonic() >= deadline and code != 0:
            raise EnvironmentFailed(
                f"building the environment took longer than {self.config.build_timeout:g} s and was stopped "
                "(the agent's --env-build-timeout)"
            )
        if code != 0:
            message = "\n".join(line for line in tail if line.strip()) or f"uv exited with code {code}"
            raise EnvironmentFailed(message)
        return "".join(kept)

    # --- collection ---------------------------------------------------------------------------

    def collect(self) -> None:
        """Delete the least recently used environments while they exceed the size budget; never one
        a node holds (its shared lock), nor one being built."""
        with self._gc_lock:
            built = [(path, _last_use(path), _size(path)) for path in self._built()]
            total = sum(size for _, _, size in built)
            for path, _, size in sorted(built, key=lambda item: item[1]):
                if total <= self.config.size_budget:
                    return
                if self._delete_unused(path):
                    total -= size
                    log.info("collected environment %s (%d MiB)", path.name[:12], size // 2**20)

    def sweep(self) -> None:
        """Before the agent takes work: remove what crashed builds and resolutions left behind."""
        if not self.root.is_dir():
            return
        for stale in [*self.root.glob(".build-*"), *self.root.glob(".resolve-*"), *self.root.glob(".trash-*")]:
            shutil.rmtree(stale, ignore_errors=True)

    def prepare(self) -> None:
        """Read the interpreter's packages and pip's configuration now, so that the first job does not
        wait for them, and collect what exceeds the size budget. Safe beside builds and nodes."""
        _ = self.index, self.interpreter
        self.collect()

    def _built(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if not path.name.startswith(".") and path.is_dir() and (path / "lock.txt").is_file():
                yield path

    def _delete_unused(self, path: Path) -> bool:
        guard = os.open(self.root / f"{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a node uses it, or it is being built
            trash = self.root / f".trash-{path.name}-{secrets.token_hex(4)}"
            os.rename(path, trash)
        finally:
            os.close(guard)
        shutil.rmtree(trash, ignore_errors=True)
        return True


def _last_use(path: Path) -> float:
    try:
        return (path / "lock.txt").stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, 9)
