"""docker-compose.yml and the Dockerfile, checked offline (no Docker engine runs here).

The compose file must be valid for the compose specification, run commands and options that the
`phalanx` CLI really has, hold together (dependencies, health checks, ports, volumes), and run the
very components the end-to-end tests start from tests/processes.py.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml

import server.db
import server.settings
from server.settings import Settings
from stack import cli

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
BALANCER_ROUTES = REPO / "deploy" / "Caddyfile"

# What a deployment needs; the brief of docker-compose.yml.
REQUIRED_SERVICES = {
    "postgres",
    "redis",
    "migrate",
    "server",
    "server-nodes",
    "balancer",
    "scheduler",
    "agent-1",
    "agent-2",
}
# The server's two pools behind the balancer: the people's calls and heartbeats, the nodes' calls.
SERVERS = ("server", "server-nodes")
ONE_SHOT = "migrate"
# Secrets that must come from the environment, never from a default in the file.
REQUIRED_SECRETS = ("PHALANX_ADMIN_TOKEN", "PHALANX_AGENT_TOKEN")
# Compose options the end-to-end stack does not pass, each with its reason.
NOT_IN_E2E = {
    # a container must listen on every interface; the tests' processes share loopback
    ("server",): {"--host"},
}
# Run once, before the components: the tests migrate with the same function (see below).
MIGRATION = ("db", "upgrade")

Command = tuple[str, ...]


# --- reading the files ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(document, dict), f"{COMPOSE_FILE.name} is not a mapping"
    return document


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def built_here(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Services that run the image built from this repository: they build it, or share its name."""
    builders = {name: s for name, s in services.items() if "build" in s}
    for name, service in builders.items():
        build = service["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (COMPOSE_FILE.parent / context).resolve() == REPO, f"{name} builds from {context}, not this repo"
        assert (REPO / context / dockerfile).resolve() == DOCKERFILE, f"{name} builds {dockerfile}"
    images = {s["image"] for s in builders.values() if "image" in s}
    return {name: s for name, s in services.items() if name in builders or s.get("image") in images}


def argv_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def split_command(argv: list[str]) -> tuple[Command, dict[str, str | None]]:
    """(subcommand path, {--option: value or None}) of a `phalanx` command line."""
    words: list[str] = []
    options: dict[str, str | None] = {}
    i = 0
    while i < len(argv) and not argv[i].startswith("-"):
        words.append(argv[i])
        i += 1
    while i < len(argv):
        token = argv[i]
        assert token.startswith("--"), f"unexpected argument {token!r} in {argv}"
        if "=" in token:
            name, value = token.split("=", 1)
            options[name] = value
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            options[token] = argv[i + 1]
            i += 2
        else:
            options[token] = None
            i += 1
    return tuple(words), options


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def cli_command(path: Command) -> Any:
    """The CLI's command object for `phalanx <path>` (typer's own click: read by duck typing)."""
    command: Any = typer.main.get_command(cli.app)
    for word in path:
        subcommands = getattr(command, "commands", None)
        assert subcommands is not None, f"`phalanx {' '.join(path)}`: {command.name} has no subcommands"
        assert word in subcommands, f"`phalanx` has no command `{' '.join(path)}`"
        command = subcommands[word]
    return command


def cli_envvars() -> set[str]:
    """Every environment variable that an option of the `phalanx` CLI reads."""
    found: set[str] = set()

    def walk(command: Any) -> None:
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            found.update([envvar] if isinstance(envvar, str) else envvar or [])
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(cli.app))
    assert "PHALANX_AGENT_TOKEN" in found, "the CLI's options are not where this test looks for them"
    return found


# --- (a) the compose specification ----------------------------------------------------------------


def test_compose_file_is_valid_for_the_compose_specification() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"compose-spec validation failed:\n{result.stdout}\n{result.stderr}"


def test_compose_file_uses_the_compose_specification_layout(compose: dict[str, Any]) -> None:
    assert "version" not in compose, "the compose specification has no `version:` key; drop it"
    assert set(compose["services"]) >= REQUIRED_SERVICES, (
        f"missing services: {sorted(REQUIRED_SERVICES - set(compose['services']))}"
    )


def test_docker_compose_v1_accepts_the_file_when_installed() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose (v1) is not installed; the compose-spec schema check above still ran")
    env = {
        **os.environ,
        "DOCKER_HOST": "tcp://127.0.0.1:1",  # nowhere: `config` must not need an engine
        **dict.fromkeys(REQUIRED_SECRETS, "offline-check"),
    }
    result = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stdout}\n{result.stderr}"


# --- (b) the commands exist in the CLI ------------------------------------------------------------


def cli_help(path: Command) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "stack", *path, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
        check=False,
    )


def test_every_phalanx_service_runs_a_command_and_options_the_cli_has(services: dict[str, dict[str, Any]]) -> None:
    ours = built_here(services)
    assert {"migrate", *SERVERS, "scheduler", "agent-1", "agent-2"} <= set(ours)
    commands = {name: split_command(argv_of(service)) for name, service in ours.items()}
    for name, (path, _) in commands.items():
        assert path, f"{name} has no `command`: the image's default only prints help"

    paths = sorted({path for path, _ in commands.values()})
    with ThreadPoolExecutor(max_workers=len(paths)) as pool:
        helps = dict(zip(paths, pool.map(cli_help, paths), strict=True))

    for name, (path, options) in commands.items():
        shown = helps[path]
        assert shown.returncode == 0, (
            f"{name}: `phalanx {' '.join(path)} --help` exited {shown.returncode}:\n{shown.stdout}{shown.stderr}"
        )
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", shown.stdout), (
                f"{name} passes {option}, which `phalanx {' '.join(path)} --help` does not list:\n{shown.stdout}"
            )


def test_every_required_option_is_given_on_the_command_line_or_by_the_environment(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in built_here(services).items():
        path, options = split_command(argv_of(service))
        env = environment_of(service)
        for param in cli_command(path).params:
            if not param.required:
                continue
            flags = set(param.opts)
            envvars = {param.envvar} if isinstance(param.envvar, str) else set(param.envvar or ())
            assert flags & set(options) or envvars & set(env), (
                f"{name}: `phalanx {' '.join(path)}` requires {'/'.join(sorted(flags))}"
                + (f" (or {', '.join(sorted(envvars))})" if envvars else "")
                + "; the service gives neither"
            )


def test_every_phalanx_variable_is_read_by_the_settings_or_the_cli(services: dict[str, dict[str, Any]]) -> None:
    known = {f"PHALANX_{field.upper()}" for field in Settings.model_fields} | cli_envvars()
    for name, service in built_here(services).items():
        unknown = {key for key in environment_of(service) if key.startswith("PHALANX_")} - known
        assert not unknown, f"{name} sets {sorted(unknown)}, which nothing in Phalanx reads (a typo?)"


def test_secrets_are_required_from_the_environment_without_defaults(services: dict[str, dict[str, Any]]) -> None:
    seen = set()
    for name, service in services.items():
        for key, value in environment_of(service).items():
            if key in REQUIRED_SECRETS:
                seen.add(key)
                assert re.fullmatch(rf"\$\{{{key}:\?[^}}]+\}}", value), (
                    f"{name}: {key} must be `${{{key}:?message}}` (required, no default), not {value!r}"
                )
    assert seen == set(REQUIRED_SECRETS)


def test_agents_get_no_database_credentials_or_admin_token(services: dict[str, dict[str, Any]]) -> None:
    for name, service in built_here(services).items():
        if split_command(argv_of(service))[0] == ("agent",):
            leaked = {"PHALANX_DATABASE_URL", "PHALANX_ADMIN_TOKEN"} & set(environment_of(service))
            assert not leaked, f"{name} is an agent (it never touches the database) but gets {sorted(leaked)}"


# --- (c) cross-references -------------------------------------------------------------------------


def has_healthcheck(service: dict[str, Any]) -> bool:
    check = service.get("healthcheck")
    return bool(check) and not check.get("disable", False) and check.get("test") not in (None, ["NONE"], "NONE")


def test_dependencies_name_services_and_wait_for_what_those_can_report(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in services.items():
        for target, condition in depends_on(service).items():
            assert target in services, f"{name} depends on {target}, which is not a service"
            assert target != name, f"{name} depends on itself"
            if condition == "service_healthy":
                assert has_healthcheck(services[target]), f"{name} waits for {target} healthy; it has no healthcheck"
            if target == ONE_SHOT:
                assert condition == "service_completed_successfully", (
                    f"{name} must wait for {ONE_SHOT} to complete successfully, not {condition}"
                )
            elif condition == "service_completed_successfully":
                raise AssertionError(f"{name} waits for {target} to complete, but {target} is a long-running service")


def test_dependencies_have_no_cycle(services: dict[str, dict[str, Any]]) -> None:
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"dependency cycle: {' -> '.join((*trail, name))}"
        if name in done:
            return
        for target in depends_on(services[name]):
            visit(target, (*trail, name))
        done.add(name)

    for name in services:
        visit(name, ())


def test_components_start_after_the_migration_and_agents_after_the_server(
    services: dict[str, dict[str, Any]],
) -> None:
    def upstream(name: str) -> Iterator[tuple[str, str]]:
        for target, condition in depends_on(services[name]).items():
            yield target, condition
            yield from upstream(target)

    for name, service in built_here(services).items():
        path = split_command(argv_of(service))[0]
        reached = dict(upstream(name))
        if path in (("server",), ("scheduler",)):
            assert reached.get(ONE_SHOT) == "service_completed_successfully", f"{name} may start before migrations"
            assert reached.get("redis") == "service_healthy", f"{name} may start before Redis answers"
        if path == ("agent",):
            for pool in SERVERS:
                assert reached.get(pool) == "service_healthy", f"{name} may start before {pool} answers"
        if path == MIGRATION:
            assert reached.get("postgres") == "service_healthy", f"{name} may run before PostgreSQL answers"


def test_the_one_shot_migration_is_not_restarted(services: dict[str, dict[str, Any]]) -> None:
    migrate = services[ONE_SHOT]
    assert split_command(argv_of(migrate))[0] == MIGRATION
    assert migrate.get("restart", "no") in ("no", "on-failure"), (
        f"{ONE_SHOT} runs once; restart: {migrate['restart']} would run it forever"
    )


def test_server_port_healthcheck_and_agents_agree(services: dict[str, dict[str, Any]]) -> None:
    ports = set()
    for name in SERVERS:
        server = services[name]
        path, options = split_command(argv_of(server))
        assert path == ("server",), f"{name} runs `phalanx {' '.join(path)}`"
        assert options.get("--host") == "0.0.0.0", f"in a container {name} must listen on every interface"
        port = options.get("--port", "8000")
        ports.add(port)
        # Clients and agents reach the replicas through the balancer, which publishes the port.
        assert "ports" not in server, f"a scaled {name} cannot publish one host port: the balancer publishes it"
        test = server["healthcheck"]["test"]
        probe = test if isinstance(test, str) else " ".join(test)
        assert f":{port}/healthz" in probe, f"{name}'s healthcheck must query /healthz on port {port}: {probe}"
        assert "urllib" in probe, "the slim image has no curl: probe with python -c urllib"
    assert len(ports) == 1, f"the server pools listen on different ports: {sorted(ports)}"
    (port,) = ports

    # The balancer runs deploy/Caddyfile (tests/e2e/test_call_classes.py runs it with real Caddy),
    # with each pool's replicas named by the variables that file reads.
    balancer = services["balancer"]
    argv = argv_of(balancer)
    config = argv[argv.index("--config") + 1]
    mounts = dict(reversed(str(v).split(":")[:2]) for v in balancer.get("volumes", []))
    assert config in mounts, f"the balancer reads {config}, which no volume mounts"
    assert (COMPOSE_FILE.parent / mounts[config]).resolve() == BALANCER_ROUTES, f"{config} is not deploy/Caddyfile"
    env = environment_of(balancer)
    assert env.get("PEOPLE_SERVERS") == f"server:{port}", "the balancer must send the people's calls to server"
    assert env.get("NODE_SERVERS") == f"server-nodes:{port}", "the balancer must send the nodes' calls to server-nodes"
    read = set(re.findall(r"\{\$([A-Z_]+)", BALANCER_ROUTES.read_text()))
    assert set(env) <= read, f"the balancer sets {sorted(set(env) - read)}, which deploy/Caddyfile never reads"
    published = [str(p).rsplit(":", 1)[-1] for p in balancer.get("ports", [])]
    assert published, "the balancer publishes no port"
    listen = env.get("BALANCER_PORT", "8000")
    assert listen in published, f"the balancer listens on {listen} but publishes {published}"
    for name in SERVERS:
        assert depends_on(balancer).get(name) == "service_healthy", f"the balancer may start before {name} answers"

    names = []
    for name, service in built_here(services).items():
        agent_path, agent_options = split_command(argv_of(service))
        if agent_path != ("agent",):
            continue
        assert agent_options.get("--server") == f"http://balancer:{listen}", f"{name} points past the balancer"
        names.append(agent_options.get("--name"))
    assert len(names) >= 2 and None not in names and len(set(names)) == len(names), f"agent names {names}"


def test_named_volumes_are_declared(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                source = volume.get("source", "") if volume.get("type") == "volume" else ""
            else:
                source = volume.split(":", 1)[0] if ":" in volume else ""
            if source and not source.startswith((".", "/", "~", "$")):
                assert source in declared, f"{name} mounts volume {source}, which `volumes:` does not declare"
    for pool in SERVERS:
        data_dir = environment_of(services[pool]).get("PHALANX_DATA_DIR")
        assert data_dir and any(str(v).endswith(f":{data_dir}") for v in services[pool].get("volumes", [])), (
            f"{pool} keeps uploaded bundles under PHALANX_DATA_DIR={data_dir}: it needs a volume there"
        )


# --- (d) the end-to-end tests start the same commands ---------------------------------------------


def stack_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[Command, set[str]], set[str]]:
    """What tests/processes.py's Stack spawns for each component, and the PHALANX_ variables it sets.

    Its own argv-building code runs; only the process start and the wait for health are replaced.
    """
    import tests.processes as processes

    for key in [k for k in os.environ if k.startswith("PHALANX_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(processes, "wait_for", lambda *args, **kwargs: True)
    stack = processes.Stack(tmp_path, "postgresql+psycopg://offline/none", "redis://offline:1/0")
    spawned: list[tuple[str, ...]] = []
    monkeypatch.setattr(stack, "spawn", lambda name, *args, **_: spawned.append(args))

    stack.start_server()
    stack.start_scheduler()
    stack.start_agent("agent-1")

    commands: dict[Command, set[str]] = {}
    for args in spawned:
        path, options = split_command(list(args))
        commands.setdefault(path, set()).update(options)
    return commands, {key for key in stack.env if key.startswith("PHALANX_")}


def test_e2e_stack_runs_the_components_compose_runs(
    services: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e2e, e2e_env = stack_commands(tmp_path, monkeypatch)
    deployed: dict[Command, set[str]] = {}
    deployed_env: set[str] = set()
    for service in built_here(services).values():
        path, options = split_command(argv_of(service))
        deployed.setdefault(path, set()).update(options)
        deployed_env |= {key for key in environment_of(service) if key.startswith("PHALANX_")}

    assert set(deployed) - {MIGRATION} == set(e2e), (
        f"compose runs {sorted(deployed)}, the end-to-end stack spawns {sorted(e2e)}"
    )
    for path, options in deployed.items():
        if path == MIGRATION:
            continue
        untested = options - e2e[path] - NOT_IN_E2E.get(path, set())
        assert not untested, (
            f"compose passes {sorted(untested)} to `phalanx {' '.join(path)}`; the end-to-end tests never do"
        )
    assert deployed_env <= e2e_env, (
        f"compose configures {sorted(deployed_env - e2e_env)}, which the end-to-end stack never sets"
    )


def test_db_upgrade_applies_the_migrations_the_tests_apply(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tests migrate with server.db.upgrade; `phalanx db upgrade` must be that, on the configured URL."""
    import tests.conftest

    assert tests.conftest.upgrade is server.db.upgrade
    url = environment_of(services[ONE_SHOT])["PHALANX_DATABASE_URL"]
    monkeypatch.setenv("PHALANX_DATABASE_URL", url)
    server.settings.get_settings.cache_clear()
    upgraded: list[str] = []
    monkeypatch.setattr(server.db, "upgrade", lambda target, *args: upgraded.append(target))
    monkeypatch.setattr(server.db, "current_revision", lambda target: "head")
    try:
        cli_command(MIGRATION).callback()
    finally:
        server.settings.get_settings.cache_clear()
    assert upgraded == [url]


# --- the Dockerfile -------------------------------------------------------------------------------


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return found


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


# `pip install .`, `pip install '.[a,b]'`, with or without options before it
PROJECT_INSTALL = re.compile(r"""pip install (\S+ )*(['"]?)\.(\[(?P<extras>[\w,-]+)\])?\2(\s|$|&)""")


def test_dockerfile_installs_torch_cpu_first_then_the_project() -> None:
    steps = instructions()
    bases = [args.split()[0] for keyword, args in steps if keyword == "FROM"]
    assert bases and all(base == "python:3.11-slim" for base in bases), bases
    runs = [args for keyword, args in steps if keyword == "RUN"]
    torch_at = next((i for i, run in enumerate(runs) if "pip install torch==" in run), None)
    projects = [(i, found) for i, run in enumerate(runs) if (found := PROJECT_INSTALL.search(run))]
    assert torch_at is not None, "the image must install torch's CPU wheel explicitly"
    assert projects, "the image must `pip install .` (or `'.[extras]'`)"
    project_at, project = projects[0]
    assert torch_at < project_at, "torch first: otherwise the project's `torch>=2.4` pulls the CUDA build"
    # docker-compose.yml's agents run the example jobs it tells users to submit (examples/digits).
    extras = (project["extras"] or "").split(",")
    assert "examples" in extras, "the image must install the examples extra: its agents run examples/"

    makefile_version = re.search(r"^TORCH_VERSION \?= (\S+)", (REPO / "Makefile").read_text(), re.M)
    docker_version = re.search(r"ARG TORCH_VERSION=(\S+)", DOCKERFILE.read_text())
    assert makefile_version and docker_version and makefile_version[1] == docker_version[1], (
        "the Dockerfile and the Makefile must pin the same torch"
    )
    assert "download.pytorch.org/whl/cpu" in runs[torch_at]


def test_dockerfile_names_no_package_index_but_pytorch_s() -> None:
    text = "\n".join(args for _, args in instructions())  # comments may show example URLs
    hosts = set(re.findall(r"https?://([^/\s\"']+)", text))
    assert hosts <= {"download.pytorch.org"}, f"unexpected hosts in the Dockerfile: {sorted(hosts)}"


def test_image_runs_phalanx_as_a_non_root_user() -> None:
    stage = final_stage()
    users = [args for keyword, args in stage if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the final stage must switch to a non-root USER"
    entrypoints = [args for keyword, args in stage if keyword == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["phalanx"], entrypoints


def test_image_copies_every_package_that_pyproject_installs() -> None:
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {
        entry.name
        for entry in REPO.iterdir()
        if (entry / "__init__.py").is_file() and any(fnmatch.fnmatch(entry.name, p) for p in patterns)
    }
    copied = set()
    for keyword, args in instructions():
        if keyword == "COPY" and "--from" not in args:
            copied.update(part.rstrip("/") for part in args.split()[:-1])
    assert packages <= copied, f"the image misses {sorted(packages - copied)}"
    assert "pyproject.toml" in copied

    ignored = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    for needed in sorted(packages | {"pyproject.toml"}):
        assert not any(fnmatch.fnmatch(needed, pattern) for pattern in ignored), f".dockerignore drops {needed}"
    for unwanted in (".git", ".venv", ".env"):
        assert unwanted in ignored, f".dockerignore must keep {unwanted} out of the build context"
