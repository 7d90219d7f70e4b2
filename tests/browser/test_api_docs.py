"""The API docs in a real browser: /docs (Swagger UI) and /redoc (ReDoc) render every operation
from the vendored files, under the same Content-Security-Policy as the dashboard, without a token,
and send no request to any other host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import ConsoleMessage, Page, Route, expect

from tests.browser.conftest import shot
from tests.processes import Stack

pytestmark = [pytest.mark.browser, pytest.mark.e2e]
REDOC_LOGO = "/redoc/logo-mini.svg"
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pg_url: str, redis_url: str) -> Iterator[Stack]:
    """The server alone: the docs need nothing else."""
    running = Stack(Path(tmp_path_factory.mktemp("docs")), pg_url, redis_url)
    try:
        running.start_server()
        yield running
    finally:
        running.close()


def operation_count(server: Stack) -> int:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    return sum(method in HTTP_METHODS for operations in schema["paths"].values() for method in operations)


def watch(page: Page, server: Stack) -> tuple[list[str], list[str]]:
    """Requests that went out to any other origin (aborted and noted here), and console messages
    reporting a policy violation."""
    outside: list[str] = []
    violations: list[str] = []

    def on_route(route: Route) -> None:
        if route.request.url.startswith(server.url + "/"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    def on_console(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text or "Refused to" in message.text:
            violations.append(message.text)

    page.route("**/*", on_route)
    page.on("console", on_console)
    page.add_init_script(
        "document.addEventListener('securitypolicyviolation',"
        " e => console.error('Content Security Policy violation: ' + e.violatedDirective + ' ' + e.blockedURI))"
    )
    return outside, violations


def test_swagger_ui_lists_every_operation_under_the_policy(server: Stack, page: Page) -> None:
    outside, violations = watch(page, server)
    answer = page.goto(server.url + "/docs")
    assert answer is not None and answer.status == 200
    assert "script-src 'self';" in answer.headers["content-security-policy"]
    operations = page.locator("#swagger-ui .opblock")
    expect(operations.first).to_be_visible(timeout=30_000)
    expect(operations).to_have_count(operation_count(server))
    expect(page.locator("#swagger-ui .opblock-summary-path", has_text="/api/v1/jobs/{job_id}").first).to_be_visible()
    shot(page, "docs")
    assert violations == [] and outside == [], (violations, outside)


def test_redoc_lists_every_operation_under_the_policy(server: Stack, page: Page) -> None:
    outside, violations = watch(page, server)
    answer = page.goto(server.url + "/redoc")
    assert answer is not None and answer.status == 200
    assert "script-src 'self';" in answer.headers["content-security-policy"]
    operations = page.locator("[data-section-id^='operation/']")
    expect(operations.first).to_be_visible(timeout=30_000)
    expect(operations).to_have_count(operation_count(server))
    shot(page, "redoc")
    # the one thing the policy stops: the logo of ReDoc's "API docs by Redocly" link, from their CDN
    assert all(REDOC_LOGO in violation for violation in violations) and outside == [], (violations, outside)
