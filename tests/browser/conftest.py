"""Browser tests: Debian's headless Chromium driven by Playwright (`executable_path`: Playwright
never downloads a browser here), against the real stack of the e2e tests. Every test saves a
screenshot of each page it visits under `test-artifacts/browser/` (or $PHALANX_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.conftest import ADMIN_TOKEN, call_failed
from tests.processes import REPO, Stack, two_agent_stack

CHROMIUM = os.environ.get("PHALANX_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("PHALANX_TEST_ARTIFACTS", REPO / "test-artifacts" / "browser"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set PHALANX_CHROMIUM)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def stack(clean_db: str, clean_redis: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    with two_agent_stack(tmp_path, clean_db, clean_redis) as running:
        yield running
        if call_failed(request):
            print(running.dump())


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    if call_failed(request):
        shot(opened, "FAILED")
    context.close()
    assert not errors, f"the page raised JavaScript errors: {errors}"


def shot(page: Page, name: str) -> Path:
    """A full-page screenshot under ARTIFACTS, named after the test and the page."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "test").split("::")[-1].split(" ")[0].removeprefix("test_")[:32]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{test}-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def sign_in(page: Page, stack: Stack, path: str) -> None:
    """Open `path` without a session: the sign-in page, then back to `path` once signed in."""
    page.goto(stack.url + path)
    assert "/login?next=" in page.url, page.url
    page.fill("input[name=token]", ADMIN_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(stack.url + path)
