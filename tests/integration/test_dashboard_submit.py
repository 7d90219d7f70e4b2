"""The submit page on a real PostgreSQL: job and study files (uploaded or pasted) with their code,
and every refusal shown beside the line of the field it names, with nothing created."""

from __future__ import annotations

import io
import re
import tarfile
import zipfile
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from fastapi.testclient import TestClient

from scheduler.service import schedule_pass
from server.app import create_app
from server.db import session_scope
from server.settings import Settings
from server.task_names import ADVANCE_STUDY_TASK, SCHEDULE_TASK
from tests.agent_tokens import as_agent, register_agent
from tests.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.integration
USER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
EMPTY_FILE = ("", b"", "application/octet-stream")  # what a browser sends for a file input left empty

JOB = """\
name: digits
entrypoint: python train.py --epochs 3
resources:
  nodes: 1
  slots_per_node: 2
hyperparameters: {lr: 0.05}
"""

STUDY = """\
name: tune
objective: {metric: val_loss, direction: minimize}
search_space:
  lr: {type: float, low: 0.001, high: 0.1, log: true}
n_trials: 4
parallelism: 2
trial:
  entrypoint: python train.py
  resources: {nodes: 1, slots_per_node: 1}
"""


@pytest.fixture
def enqueued() -> list[tuple[Any, ...]]:
    return []


@pytest.fixture
def client(settings: Settings, enqueued: list[tuple[Any, ...]]) -> Iterator[TestClient]:
    app = create_app(settings, enqueue=lambda *task, **_: enqueued.append(task))
    with TestClient(app, follow_redirects=False) as test_client:
        body = {"name": "a0", "address": "127.0.0.1", "cpu_slots": 2}
        register_agent(test_client, **body)
        response = test_client.post("/login", data={"token": ADMIN_TOKEN, "csrf_token": csrf(test_client)})
        assert response.status_code == 303
        yield test_client


def csrf(client: TestClient, page: str = "/login") -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', client.get(page).text)
    assert match
    return match.group(1)


def post(
    client: TestClient,
    text: str = "",
    file: str | bytes | None = None,
    bundle: tuple[str, bytes] | None = None,
    token: str | None = "",
) -> Any:
    data = {"spec_text": text}
    if token is not None:
        data["csrf_token"] = token or csrf(client, "/submit")
    files: dict[str, Any] = {
        "spec_file": ("job.yaml", file, "application/yaml") if file is not None else EMPTY_FILE,
        "bundle": (bundle[0], bundle[1], "application/octet-stream") if bundle else EMPTY_FILE,
    }
    return client.post("/submit", data=data, files=files)


def jobs(client: TestClient) -> list[dict[str, Any]]:
    return list(client.get("/api/v1/jobs", headers=USER).json())


def studies(client: TestClient) -> list[dict[str, Any]]:
    return list(client.get("/api/v1/studies", headers=USER).json())


def tar_gz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def schedule(settings: Settings) -> None:
    with session_scope(settings.database_url) as session:
        schedule_pass(session)


def stored_bundle(client: TestClient, settings: Settings, job_id: int) -> dict[str, bytes]:
    schedule(settings)  # an agent fetches the code of the jobs it hosts
    response = client.get(f"/api/v1/jobs/{job_id}/bundle", headers=as_agent(1))
    assert response.status_code == 200, response.text
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


class Listing(HTMLParser):
    """The page's error parts in document order: ("line", n, text), ("problem", n, field, message)
    inside the numbered listing, and ("top", field, message) for the problems above it."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.items: list[tuple[Any, ...]] = []
        self._open: list[Any] | None = None
        self._depth = 0
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if self._open is not None:
            self._depth += 1
        elif tag == "div" and "line" in classes:
            self._open, self._depth = ["line", int(a["data-line"] or 0), ""], 0
        elif tag == "div" and "problem" in classes:
            self._open, self._depth = ["problem", int(a["data-line"] or 0), a["data-field"], ""], 0
        elif tag == "li" and "problem" in classes:
            self._open, self._depth = ["top", a["data-field"], ""], 0

    def handle_endtag(self, tag: str) -> None:
        if self._open is None:
            return
        if self._depth:
            self._depth -= 1
            return
        if self._open[0] == "line":  # drop the number's own text
            self._open[2] = self._open[2].removeprefix(str(self._open[1]))
        self.items.append(tuple(self._open))
        self._open = None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open[-1] += data

    def top(self) -> list[tuple[Any, ...]]:
        return [item for item in self.items if item[0] == "top"]

    def under(self, line: int) -> list[tuple[Any, ...]]:
        """The problems right after line `line` (before the next line)."""
        index = next(i for i, item in enumerate(self.items) if item[:2] == ("line", line))
        following = []
        for item in self.items[index + 1 :]:
            if item[0] != "problem":
                break
            following.append(item)
        return following


def test_the_page_needs_a_session_and_offers_both_ways(client: TestClient) -> None:
    page = client.get("/submit")
    assert page.status_code == 200
    assert 'enctype="multipart/form-data"' in page.text and 'name="csrf_token"' in page.text
    for name in ("spec_file", "spec_text", "bundle"):
        assert f'name="{name}"' in page.text
    assert "the uploaded file is used" in page.text
    client.cookies.delete("phalanx_session")
    assert client.get("/submit").headers["location"] == "/login?next=/submit"


def test_an_uploaded_job_file_becomes_a_queued_job(
    client: TestClient, settings: Settings, enqueued: list[tuple[Any, ...]]
) -> None:
    response = post(client, file=JOB)
    assert response.status_code == 303, response.text
    [job] = jobs(client)
    assert response.headers["location"] == f"/jobs/{job['id']}"
    assert job["state"] == "QUEUED" and job["name"] == "digits"
    assert job["spec"]["entrypoint"] == "python train.py --epochs 3"
    assert job["spec"]["resources"] == {"nodes": 1, "slots_per_node": 2, "slot_type": "cpu"}
    assert job["spec"]["hyperparameters"] == {"lr": 0.05}
    assert (SCHEDULE_TASK,) in enqueued  # kicked, as the REST route does
    assert client.get(response.headers["location"]).status_code == 200
    schedule(settings)
    assert client.get(f"/api/v1/jobs/{job['id']}/bundle", headers=as_agent(1)).status_code == 404  # no code sent


def test_pasted_yaml_with_a_tar_gz_bundle(client: TestClient, settings: Settings) -> None:
    code = tar_gz({"train.py": b"print('hi')\n"})
    response = post(client, text=JOB.replace("\n", "\r\n"), bundle=("code.tar.gz", code))  # as browsers send it
    assert response.status_code == 303, response.text
    [job] = jobs(client)
    assert stored_bundle(client, settings, job["id"]) == {"./train.py": b"print('hi')\n"}


def test_a_zip_is_stored_as_the_same_tar_gz(client: TestClient, settings: Settings) -> None:
    code = zipped({"train.py": b"print('hi')\n", "lib/util.py": b"X = 1\n"})
    response = post(client, text=JOB, bundle=("code.zip", code))
    assert response.status_code == 303, response.text
    [job] = jobs(client)
    assert stored_bundle(client, settings, job["id"]) == {"./train.py": b"print('hi')\n", "./lib/util.py": b"X = 1\n"}


def test_bad_archives_are_refused_and_must_be_chosen_again(client: TestClient) -> None:
    escaping = post(client, text=JOB, bundle=("code.zip", zipped({"../evil.py": b"x"})))
    assert escaping.status_code == 422 and "outside its folder" in escaping.text
    neither = post(client, text=JOB, bundle=("code.rar", b"Rar!\x1a\x07\x00 not an archive we take"))
    assert neither.status_code == 422 and "neither a .tar.gz nor a .zip" in neither.text
    assert "Choose the code archive again" in neither.text
    assert jobs(client) == []


def test_the_uploaded_file_wins_over_the_box(client: TestClient) -> None:
    response = post(client, text="name: from-the-box\nentrypoint: python x.py\n", file=JOB)
    assert response.status_code == 303
    assert [job["name"] for job in jobs(client)] == ["digits"]


def test_a_study_file_becomes_a_study_and_its_driver_starts(
    client: TestClient, enqueued: list[tuple[Any, ...]]
) -> None:
    code = tar_gz({"train.py": b"pass\n"})
    response = post(client, file=STUDY, bundle=("code.tar.gz", code))
    assert response.status_code == 303, response.text
    [study] = studies(client)
    assert response.headers["location"] == f"/studies/{study['id']}"
    assert study["name"] == "tune" and study["spec"]["n_trials"] == 4
    assert (ADVANCE_STUDY_TASK, study["id"]) in enqueued
    assert jobs(client) == []  # the trials are the driver's to create


def test_a_bad_field_is_shown_under_its_line_and_nothing_is_created(client: TestClient) -> None:
    text = JOB.replace("nodes: 1", "nodes: 0").replace("resources:", "priority: 500\nresources:")
    response = post(client, text=text)
    assert response.status_code == 422
    listing = Listing(response.text)
    # line 3 is `priority: 500`, line 5 is `  nodes: 0`
    [priority] = listing.under(3)
    assert priority[2] == "priority" and "less than or equal to 100" in priority[3]
    [nodes] = listing.under(5)
    assert nodes[2] == "resources.nodes" and "greater than or equal to 1" in nodes[3]
    assert listing.under(4) == [] and listing.top() == []
    assert ("line", 5, "  nodes: 0") in listing.items
    assert "2 problems shown under the lines they name" in response.text
    assert re.search(r'<a href="#line-3">line 3</a>, <a href="#line-5">line 5</a>\.', response.text)
    assert f">\n{text}</textarea>" in response.text  # kept for editing
    assert jobs(client) == []


def test_a_missing_field_is_named_at_the_top_and_an_unknown_one_at_its_line(client: TestClient) -> None:
    response = post(client, text="name: j\nresources:\n  nodes: 1\n  gpus: 2\n")
    assert response.status_code == 422
    listing = Listing(response.text)
    [missing] = listing.top()
    assert missing[1] == "entrypoint" and "required" in missing[2]
    [extra] = listing.under(4)
    assert extra[2] == "resources.gpus" and "Extra inputs are not permitted" in extra[3]
    assert jobs(client) == []


def test_study_problems_point_into_the_search_space_and_the_trial(client: TestClient) -> None:
    text = (
        STUDY.replace("low: 0.001", "low: 0.5")
        .replace("parallelism: 2", "parallelism: 2\nenqueue: [{lr: 0.01, depth: 3}]")
        .replace("  entrypoint: python train.py", "  name: nope\n  entrypoint: python train.py")
    )
    response = post(client, text=text)
    assert response.status_code == 422
    listing = Listing(response.text)
    lines = text.splitlines()
    [low] = listing.under(lines.index("  lr: {type: float, low: 0.5, high: 0.1, log: true}") + 1)
    assert low[2] == "search_space.lr" and "low (0.5) is above high (0.1)" in low[3]
    [name] = listing.under(lines.index("trial:") + 1)
    assert name[2] == "trial" and "trial.name is not used" in name[3]
    assert "The study file was not submitted" in response.text
    assert studies(client) == [] and jobs(client) == []


def test_a_model_level_study_problem_lands_on_the_field_its_message_names(client: TestClient) -> None:
    text = STUDY.replace("parallelism: 2", "parallelism: 2\nenqueue:\n  - {lr: 0.01, depth: 3}")
    response = post(client, text=text)
    assert response.status_code == 422
    [problem] = Listing(response.text).under(text.splitlines().index("  - {lr: 0.01, depth: 3}") + 1)
    assert problem[2] == "enqueue[0].depth" and "is not in the search space" in problem[3]
    assert studies(client) == []


def test_a_yaml_syntax_error_names_its_line_and_column(client: TestClient) -> None:
    text = "name: j\nentrypoint: python t.py\nresources: {nodes: 1\npriority: 3\n"
    response = post(client, text=text)
    assert response.status_code == 422
    listing = Listing(response.text)
    [problem] = [item for item in listing.items if item[0] == "problem"]
    assert re.search(r"Not valid YAML at line \d+, column \d+", problem[3])
    line = int(re.search(r"line (\d+)", problem[3]).group(1))  # type: ignore[union-attr]
    assert problem[1] == line and listing.under(line) == [problem]
    assert jobs(client) == []


def test_text_that_is_not_a_mapping_or_nothing_at_all(client: TestClient) -> None:
    empty = post(client, text="  \n")
    assert empty.status_code == 422 and "Upload a job or study file, or paste one" in empty.text
    listed = post(client, text="- name: j\n")
    assert listed.status_code == 422 and "this one is a list" in listed.text
    bomb = post(
        client,
        text="a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, c in zip("abcdefg", "bcdefgh", strict=True)
        ),
    )
    assert bomb.status_code == 422 and "expands to over" in bomb.text
    assert jobs(client) == []


def test_a_job_no_agent_could_host_is_refused_at_the_top(client: TestClient) -> None:
    response = post(client, text=JOB.replace("nodes: 1", "nodes: 3"))
    assert response.status_code == 422
    [problem] = Listing(response.text).top()
    assert "can never be placed" in problem[2]
    assert jobs(client) == []
    study = post(client, text=STUDY.replace("slots_per_node: 1", "slots_per_node: 9"))
    assert study.status_code == 422 and "can never be placed" in study.text
    assert studies(client) == []


def test_a_form_without_its_csrf_token_is_forbidden(client: TestClient, enqueued: list[tuple[Any, ...]]) -> None:
    before = list(enqueued)
    assert post(client, file=JOB, token=None).status_code == 403
    forged = post(client, file=JOB, token="forged")
    assert forged.status_code == 403 and "CSRF" in forged.text
    assert jobs(client) == [] and enqueued == before


def test_user_text_is_escaped(client: TestClient) -> None:
    text = "name: <script>alert(1)</script>\nentrypoint: python t.py\n"
    response = post(client, text=text)
    assert response.status_code == 422
    assert "<script>alert(1)</script>" not in response.text
    assert response.text.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 2  # the listing and the box
    [problem] = Listing(response.text).under(1)
    assert problem[2] == "name"
    assert jobs(client) == []
