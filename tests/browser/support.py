"""Helpers for browser tests: finding Playwright and Chromium, the operator's login, screenshots as artifacts."""

import os
import re
import secrets

from tests.e2e.harness import REPO_ROOT
from tests.services import missing_service

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError as exc:  # every browser test is then skipped (CI: failed) by require_playwright()
    expect = sync_playwright = None
    _PLAYWRIGHT_MISSING = f"Playwright is not installed ({exc}): pip install -r requirements.txt"
else:
    _PLAYWRIGHT_MISSING = None

DEFAULT_CHROMIUM = "/usr/bin/chromium"  # Debian's package `chromium`; .ci/run installs it when missing
ARTIFACTS_DIR = REPO_ROOT / "test-artifacts" / "browser"
VIEWPORT = {"width": 1400, "height": 900}
DEFAULT_TIMEOUT_MS = 10_000  # every action, navigation and expect() of a page

# The superuser the harness creates (with no password); the browser fixtures give it this one for the session.
ADMIN_USERNAME = "admin"
ADMIN_PASSWORD = f"browser-{secrets.token_urlsafe(12)}"


def chromium_executable():
    """Return the Chromium to drive (SIMPLETUNER_CHROMIUM, default /usr/bin/chromium); skip (CI: fail) if missing."""
    path = os.environ.get("SIMPLETUNER_CHROMIUM") or DEFAULT_CHROMIUM
    if not os.access(path, os.X_OK):
        missing_service(f"Chromium not found at {path}: apt-get install chromium, or set SIMPLETUNER_CHROMIUM")
    return path


def require_playwright():
    """Skip (CI: fail) the test if the Playwright package cannot be imported."""
    if _PLAYWRIGHT_MISSING:
        missing_service(_PLAYWRIGHT_MISSING)


def set_password(orchestrator, username, password):
    """Give ``username`` on ``orchestrator`` the password ``password`` (through ``manage.py shell``)."""
    orchestrator.manage(
        "shell",
        "-c",
        "from django.contrib.auth import get_user_model\n"
        f"user = get_user_model().objects.get(username={username!r})\n"
        f"user.set_password({password!r})\n"
        "user.save(update_fields=['password'])\n",
    )


def submit_login_form(page, username, password):
    """Open the admin's login page and submit ``username`` and ``password`` through the form."""
    page.goto("/admin/login/?next=/admin/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()


def artifact_name(text):
    """Return ``text`` as a safe file name stem (a test's node id, a page name)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.") or "page"


def screenshot(page, name):
    """Save a full-page PNG of ``page`` as test-artifacts/browser/<name>.png; return its path."""
    ARTIFACTS_DIR.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS_DIR / f"{artifact_name(name)}.png"
    page.screenshot(path=path, full_page=True)
    return path
