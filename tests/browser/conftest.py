"""Fixtures for browser tests: one live orchestrator and one headless Chromium per session, a fresh page per test.

Without Playwright or Chromium every browser test is skipped with the reason (under CI=true: fails).
A failing test leaves a screenshot named after it in test-artifacts/browser/ and gets the server's log,
the page's URL and its JavaScript errors attached to its report.
"""

import re

import pytest

from tests.e2e.agent_harness import AgentRunner, write_import_blocker
from tests.e2e.harness import Fleet, Orchestrator

from .support import (
    ADMIN_PASSWORD,
    ADMIN_USERNAME,
    DEFAULT_TIMEOUT_MS,
    VIEWPORT,
    chromium_executable,
    expect,
    require_playwright,
    screenshot,
    set_password,
    submit_login_form,
    sync_playwright,
)

_REPORTS = pytest.StashKey[dict]()  # the test's reports by phase ("setup", "call"), for the page's teardown
_SERVER_LOG = pytest.StashKey[tuple]()  # (orchestrator, log offset when the test's page opened)


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium (Debian's, or SIMPLETUNER_CHROMIUM) under Playwright's sync API, for the whole session."""
    require_playwright()
    executable = chromium_executable()
    expect.set_options(timeout=DEFAULT_TIMEOUT_MS)
    with sync_playwright() as playwright:
        # Chromium's sandbox cannot start as root in a container: no sandbox (Playwright then passes
        # --no-sandbox; it also passes --disable-dev-shm-usage, for a small /dev/shm).
        browser = playwright.chromium.launch(executable_path=executable, headless=True, chromium_sandbox=False)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def live_orchestrator(tmp_path_factory):
    """A running orchestrator (daphne, SQLite in its own data dir) whose superuser ADMIN_USERNAME has ADMIN_PASSWORD."""
    server = Orchestrator(backend="sqlite", data_dir=tmp_path_factory.mktemp("orchestrator-browser")).start()
    try:
        set_password(server, ADMIN_USERNAME, ADMIN_PASSWORD)
        yield server
    finally:
        server.stop()


@pytest.fixture
def page(request, browser, live_orchestrator):
    """A page in a fresh browser context (no cookies) whose relative URLs go to the live orchestrator.

    If the test fails, the page is saved as test-artifacts/browser/FAILED-<test>.png before it closes.
    """
    if not live_orchestrator.is_alive():
        pytest.fail(f"the orchestrator is no longer running:\n{live_orchestrator.read_log()}", pytrace=False)
    request.node.stash[_SERVER_LOG] = (live_orchestrator, live_orchestrator.log_size())
    context = browser.new_context(base_url=live_orchestrator.base_url, viewport=VIEWPORT)
    context.set_default_timeout(DEFAULT_TIMEOUT_MS)
    page = context.new_page()
    js_errors = []

    def console(message):
        if message.type == "error":
            js_errors.append(f"console: {message.text}")

    page.on("console", console)
    page.on("pageerror", lambda error: js_errors.append(f"uncaught: {error}"))
    try:
        yield page
        failed = [report for report in request.node.stash.get(_REPORTS, {}).values() if report.failed]
        if failed:
            _attach_page(failed, page, request.node, js_errors)
    finally:
        context.close()


def _attach_page(reports, page, item, js_errors):
    """Save a screenshot of ``page`` for a failed ``item``; add its path, URL and JS errors to ``reports``."""
    try:
        shot = str(screenshot(page, f"FAILED-{item.nodeid.removeprefix('tests/browser/')}"))
    except Exception as exc:  # noqa: BLE001 - a crashed page must not hide the test's own failure
        shot = f"(no screenshot: {exc})"
    text = f"screenshot: {shot}\nurl: {page.url}\n" + "".join(f"{line}\n" for line in js_errors)
    for report in reports:
        report.sections.append(("browser page at teardown", text))


@pytest.fixture
def logged_in_page(page):
    """``page`` after logging in as ADMIN_USERNAME through the admin's login form, on the admin index."""
    submit_login_form(page, ADMIN_USERNAME, ADMIN_PASSWORD)
    page.wait_for_url(re.compile(r"/admin/$"))
    expect(page.get_by_role("button", name="Log out")).to_be_visible()
    return page


@pytest.fixture
def agents(request, live_orchestrator, tmp_path):
    """Real ``python -m worker_agent`` processes for one test, on workers made through the admin API.

    ``agents.start(agents.fleet.create_worker(labels=...))`` starts one; ``agents.wait_ready(agent)`` waits
    until it is connected. Afterwards the agents are killed, their streams closed, their workers offline.
    """
    fleet = Fleet(live_orchestrator, request.node.originalname.removeprefix("test_").replace("_", "-"))
    blocker_dir = write_import_blocker(tmp_path / "no-django")
    runner = AgentRunner(live_orchestrator, fleet, tmp_path / "agents", blocker_dir=blocker_dir)
    try:
        yield runner
    finally:
        runner.cleanup()
        fleet.cleanup()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item for the page's teardown; attach the server log to a failure."""
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    entry = item.stash.get(_SERVER_LOG, None)
    if entry is not None and report.failed:
        server, offset = entry
        report.sections.append((f"orchestrator log ({server.log_path})", server.read_log(offset)))
    return report
