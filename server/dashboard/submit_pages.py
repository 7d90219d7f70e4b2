"""The submit page: upload a job or study file (and its code); mistakes shown beside the field they name.

A submission takes the REST API's own path (`parse_spec`, then `commands.submit_job` / `submit_study`): the
same validation, the same refusal of what no agent could ever host, the same wake-ups after commit.
What this module adds is the form's side: reading YAML (pasted or uploaded), telling a study file
from a job file, repacking a .zip of the code as the .tar.gz the API stores, and pointing each
problem at the line of the file where its field sits."""

from __future__ import annotations

import re
import stat
import tarfile
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Annotated, Any, BinaryIO

import yaml
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import RedirectResponse, Response
from pydantic_core import ErrorDetails

from phalanx import schemas
from phalanx.bundle_limits import BundleLimits
from server import commands
from server.api.deps import SessionDep, SettingsDep, get_settings
from server.api.uploads import InvalidSpec, parse_spec
from server.bundles import bundle_limits
from server.dashboard.render import CsrfChecked, SignedIn, render
from server.errors import PhalanxError, Unprocessable
from server.settings import Settings

router = APIRouter(include_in_schema=False)

STUDY_MARKERS = ("trial", "search_space", "objective")  # fields only a study file has (and must have)
MAX_SPEC_BYTES = 1 << 20
MAX_YAML_NODES = 100_000  # after aliases are expanded: `&a [*a, *a, ...]` nests to billions
LINE_BREAK = re.compile(r"\r\n|[\n\r\x85\u2028\u2029]")  # YAML's line breaks, which its marks count
FIELD_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\.[\w-]+|\[\d+\])*)(?=[: ])")  # "enqueue[0].lr: ..." in a message


@dataclass
class Problem:
    field: str  # dotted path of the field as written in the file; "" for the file as a whole
    message: str
    line: int | None = None  # 1-based line where the field's key sits; None: shown at the top


@dataclass
class Listing:
    """The submitted YAML as numbered lines, each with the problems that point at it."""

    lines: list[tuple[int, str, list[Problem]]]
    top: list[Problem] = field(default_factory=list)

    @property
    def placed(self) -> int:
        return sum(len(problems) for _, _, problems in self.lines)


class FormRefused(Exception):
    """What the form itself refuses before any spec is validated (no file, not YAML, a bad archive)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.problem = Problem("", message, line)


@router.get("/submit", response_model=None)
def submit_page(request: Request, _: SignedIn) -> Response:
    return form_page(request, 200, yaml_text="", listing=None, kind=None, bundle_lost=False)


def form_page(request: Request, status: int, **context: Any) -> Response:
    cap = get_settings(request).max_bundle_bytes >> 20
    return render(request, "submit.html", status, title="Submit", max_bundle_mib=cap, **context)


@router.post("/submit", response_model=None)
def submit(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: SignedIn,
    _: CsrfChecked,
    spec_file: Annotated[UploadFile | None, File()] = None,
    spec_text: Annotated[str, Form()] = "",
    bundle: Annotated[UploadFile | None, File()] = None,
) -> Response:
    text, kind, root = spec_text, None, None
    try:
        text = normalise(read_spec_file(spec_file) if chosen(spec_file) else spec_text)
        data, root = parse_yaml(text)
        kind = "study" if any(key in data for key in STUDY_MARKERS) else "job"
        with tempfile.TemporaryFile() as scratch:  # a .zip's code, repacked
            if kind == "study":
                study_spec = parse_spec(schemas.StudySpec, data, "study file")
                code = code_bundle(bundle, settings, scratch)
                study = commands.submit_study(session, settings, user, study_spec, code.file if code else None)
                return RedirectResponse(f"/studies/{study.id}", status_code=303)
            job_spec = parse_spec(schemas.JobSpec, data, "job file")
            code = code_bundle(bundle, settings, scratch)
            job = commands.submit_job(session, settings, user, job_spec, code.file if code else None)
            return RedirectResponse(f"/jobs/{job.id}", status_code=303)
    except FormRefused as exc:
        listing, status = annotate(text, [exc.problem]), 422
    except InvalidSpec as exc:
        assert root is not None  # a spec is validated only once its YAML was read
        listing, status = annotate(text, [locate(root, e) for e in exc.errors]), exc.status_code
    except PhalanxError as exc:  # no agent could ever host it, the code is over the cap, ...
        listing, status = annotate(text, [Problem("", exc.message)]), exc.status_code
    return form_page(request, status, yaml_text=text, listing=listing, kind=kind, bundle_lost=chosen(bundle))


def chosen(upload: UploadFile | None) -> bool:
    """A file input the user filled (browsers send an empty, nameless part for one left empty)."""
    return upload is not None and bool(upload.filename)


def normalise(text: str) -> str:
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def read_spec_file(upload: UploadFile | None) -> str:
    assert upload is not None
    raw = upload.file.read(MAX_SPEC_BYTES + 1)
    if len(raw) > MAX_SPEC_BYTES:
        raise FormRefused(f"{upload.filename} is over {MAX_SPEC_BYTES >> 20} MiB: is it really a job or study file?")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormRefused(f"{upload.filename} is not UTF-8 text (byte {exc.start}): upload the YAML file") from exc


def parse_yaml(text: str) -> tuple[dict[str, Any], yaml.Node]:
    """The file's fields and its node tree (which knows the line of every key), in one parse."""
    if not text.strip():
        raise FormRefused("Upload a job or study file, or paste one into the box.")
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None:
            expanded_size(root, {}, set())
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = ": ".join(part for part in (exc.context, exc.problem) if part)
        raise FormRefused(f"Not valid YAML at {where}: {problem}.", mark.line + 1 if mark else None) from exc
    except yaml.YAMLError as exc:
        raise FormRefused(f"Not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise FormRefused("The YAML nests too deeply to read.") from exc
    finally:
        loader.dispose()
    if not isinstance(data, dict) or root is None:
        found = "empty" if data is None else f"a {type(data).__name__}"
        raise FormRefused(
            f"A job or study file is a YAML mapping of fields (name: ..., entrypoint: ...); this one is {found}.",
            root.start_mark.line + 1 if root is not None else None,
        )
    return data, root


def expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many nodes the document holds once its aliases are expanded; refuses a bomb or a cycle."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise FormRefused("The YAML refers to itself through an alias (&anchor ... *anchor inside it).")
    open_nodes.add(key)
    size = 1
    if isinstance(node, yaml.MappingNode):
        size += sum(expanded_size(k, sizes, open_nodes) + expanded_size(v, sizes, open_nodes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size += sum(expanded_size(item, sizes, open_nodes) for item in node.value)
    if size > MAX_YAML_NODES:
        raise FormRefused(f"The YAML expands to over {MAX_YAML_NODES} values through its aliases.")
    open_nodes.discard(key)
    sizes[key] = size
    return size


# --- pointing at the field -----------------------------------------------------------------------


def child(node: yaml.Node, part: int | str) -> tuple[yaml.Node, int] | None:
    """The node at `part` under `node` and the line its key (or item) starts on; None if absent."""
    if isinstance(node, yaml.MappingNode):
        found = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)]
        return (found[-1][1], found[-1][0].start_mark.line) if found else None  # the last one wins, as in loading
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        item = node.value[part]
        return item, item.start_mark.line
    return None


def walk(root: yaml.Node, loc: tuple[int | str, ...]) -> tuple[int | None, list[str]]:
    """Follow a pydantic path through the file as far as it goes: the line of the deepest key found
    and the keys walked. Parts that name no key (a union's tag or member, `[key]`) are stepped over."""
    node, line, path = root, None, []
    for index, part in enumerate(loc):
        found = child(node, part)
        if found is None:
            if any(child(node, later) is not None for later in loc[index + 1 : index + 2]):
                continue  # "objective.Objective.metric": the member's name, then a real key
            break
        node, line = found
        path.append(str(part))
    return (None if line is None else line + 1), path


def locate(root: yaml.Node, error: ErrorDetails) -> Problem:
    loc = tuple(error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":  # the field is not in the file: name it at the top
        _, parent = walk(root, loc[:-1])
        return Problem(".".join([*parent, str(loc[-1])]), "required, but the file does not set it")
    if not loc:  # the spec as a whole; its message often starts with the field it is about
        match = FIELD_PREFIX.match(message)
        if match:
            parts = tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[|\]\.?", match.group(1)) if p)
            line, path = walk(root, parts)
            if line is not None and len(path) == len(parts):
                return Problem(match.group(1), message.removeprefix(match.group(1)).lstrip(": "), line)
        return Problem("", message)
    line, path = walk(root, loc)
    return Problem(".".join(path), message, line)


def annotate(text: str, problems: list[Problem]) -> Listing:
    lines = LINE_BREAK.split(text)
    if lines and not lines[-1]:
        lines.pop()
    listing = Listing([(number, line, []) for number, line in enumerate(lines, start=1)])
    for problem in problems:
        if problem.line is not None and lines and problem.line >= 1:  # past the end: YAML's end of stream
            listing.lines[min(problem.line, len(lines)) - 1][2].append(problem)
        else:
            listing.top.append(problem)
    return listing


# --- the code ------------------------------------------------------------------------------------


def code_bundle(upload: UploadFile | None, settings: Settings, scratch: BinaryIO) -> UploadFile | None:
    """The workdir upload as the .tar.gz the API stores: a .tar.gz as it is, a .zip repacked into
    `scratch`."""
    if upload is None or not chosen(upload):
        return None
    head = upload.file.read(4)
    upload.file.seek(0)
    if head.startswith(b"\x1f\x8b"):
        return upload
    if head in (b"PK\x03\x04", b"PK\x05\x06"):
        repack_zip(upload, bundle_limits(settings), scratch)
        return UploadFile(scratch, filename="bundle.tar.gz")
    raise Unprocessable(
        f"The code archive {upload.filename} is neither a .tar.gz nor a .zip: archive the workdir's contents, "
        "e.g. tar czf code.tar.gz -C my-workdir ."
    )


def repack_zip(upload: UploadFile, limits: BundleLimits, out: BinaryIO) -> None:
    """A .zip as a .tar.gz whose entries are "./name", as `phalanx submit` packs a workdir (the
    bundle store checks the result again, entry by entry)."""
    max_unpacked = limits.max_unpacked_bytes
    try:
        with zipfile.ZipFile(upload.file) as archive, tarfile.open(fileobj=out, mode="w:gz") as tar:
            if len(archive.infolist()) > limits.max_files:
                raise Unprocessable(f"The .zip has more than {limits.max_files} files; leave data sets out of it.")
            unpacked = 0
            for entry in archive.infolist():
                name = entry.filename
                mode = entry.external_attr >> 16
                if name.startswith("/") or "\\" in name or ".." in PurePosixPath(name).parts:
                    raise Unprocessable(f"The .zip has an entry outside its folder ({name!r}); it is refused.")
                if stat.S_ISLNK(mode):
                    raise Unprocessable(f"The .zip holds a symbolic link ({name!r}); upload a .tar.gz to keep it.")
                unpacked += entry.file_size
                if unpacked > max_unpacked:
                    raise Unprocessable(f"The .zip unpacks to over {max_unpacked >> 20} MiB; keep data sets out of it.")
                info = tarfile.TarInfo("./" + name.rstrip("/"))
                info.mtime = int(time.mktime((*entry.date_time, 0, 0, -1)))
                if entry.is_dir():
                    info.type, info.mode = tarfile.DIRTYPE, (mode & 0o777) or 0o755
                    tar.addfile(info)
                else:
                    info.size, info.mode = entry.file_size, (mode & 0o777) or 0o644
                    with archive.open(entry) as source:
                        tar.addfile(info, source)
    except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError) as exc:
        raise Unprocessable(f"The .zip {upload.filename} cannot be read: {exc}") from exc
    out.seek(0)
