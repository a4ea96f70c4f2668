"""Deployment defaults (issue 12, finding 7): production mode refuses unsafe settings, HTTPS settings
follow TLS, the data directory is private, token-issuing answers are never cached, sse_url does not
reflect an arbitrary Host, and worker-supplied names cannot drive an operator's terminal."""

import os
import secrets
import stat
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings

from common.humanize import printable
from workers.models import WorkerType
from workers.tests.factories import WorkerFactory, worker_token

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRONG_KEY = secrets.token_urlsafe(50)


def manage(tmp_path, *args, **env):
    """Run ``manage.py ARGS`` in a fresh process with ``env`` on top of a clean environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "SIMPLETUNER_"))}
    clean.pop("DATABASE_URL", None)
    clean.pop("REDIS_URL", None)
    clean["SIMPLETUNER_DATA_DIR"] = str(tmp_path / "data")
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("env", "refusal"),
    [
        ({"DJANGO_ALLOWED_HOSTS": "orch.example.com"}, "production mode needs DJANGO_SECRET_KEY"),
        ({"DJANGO_SECRET_KEY": "CHANGE-ME", "DJANGO_ALLOWED_HOSTS": "orch.example.com"}, "example or too weak"),
        ({"DJANGO_SECRET_KEY": "django-insecure-" + "x" * 50, "DJANGO_ALLOWED_HOSTS": "orch.example.com"}, "example or too weak"),
        ({"DJANGO_SECRET_KEY": "short", "DJANGO_ALLOWED_HOSTS": "orch.example.com"}, "example or too weak"),
        ({"DJANGO_SECRET_KEY": STRONG_KEY}, "production mode needs DJANGO_ALLOWED_HOSTS"),
        ({"DJANGO_SECRET_KEY": STRONG_KEY, "DJANGO_ALLOWED_HOSTS": "*"}, "production mode needs DJANGO_ALLOWED_HOSTS"),
    ],
    ids=["no-key", "example-key", "insecure-key", "short-key", "no-hosts", "any-host"],
)
def test_production_mode_refuses_to_start_with_unsafe_settings(tmp_path, env, refusal):
    result = manage(tmp_path, "check", SIMPLETUNER_PRODUCTION="true", **env)
    assert result.returncode != 0
    assert refusal in result.stderr
    assert STRONG_KEY not in result.stderr  # a secret is never echoed


@pytest.mark.parametrize("proxy", ["true", "false"], ids=["behind-a-tls-proxy", "serving-tls-itself"])
def test_production_mode_passes_check_deploy(tmp_path, proxy):
    result = manage(
        tmp_path,
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        SIMPLETUNER_PRODUCTION="true",
        DJANGO_SECRET_KEY=STRONG_KEY,
        DJANGO_ALLOWED_HOSTS="orch.example.com",
        DJANGO_BEHIND_TLS_PROXY=proxy,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "no issues" in result.stdout


def test_the_data_directory_is_its_owners_only(tmp_path):
    loose = tmp_path / "data"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    assert manage(tmp_path, "check").returncode == 0
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


@pytest.mark.django_db
def test_answers_that_issue_tokens_are_never_cached(operator_client):
    created = operator_client.post("/api/admin/workers", {"name": "cache-test", "worker_type": WorkerType.PERSISTENT}, format="json")
    assert created.status_code == 201 and created.json()["token"]
    assert created["Cache-Control"] == "no-store"
    worker = WorkerFactory()
    rotated = operator_client.post(f"/api/admin/workers/{worker.pk}/token")
    assert rotated.status_code == 200 and rotated["Cache-Control"] == "no-store"
    assert operator_client.get("/api/queue/")["Cache-Control"] == "no-store"  # job configs hold secrets


@pytest.mark.django_db
def test_sse_url_uses_the_public_url_not_the_requests_host(worker_client):
    worker = WorkerFactory()
    client = worker_client(worker, token=worker_token(worker))
    with override_settings(PUBLIC_URL="https://orch.example.com", ALLOWED_HOSTS=["*"]):
        answer = client.post("/api/workers/register", {}, format="json", HTTP_HOST="evil.example.net")
    assert answer.status_code == 200
    assert answer.json()["sse_url"] == f"https://orch.example.com/api/workers/stream?worker_id={worker.pk}"
    with override_settings(ALLOWED_HOSTS=["orch.example.com"]):
        refused = client.post("/api/workers/register", {}, format="json", HTTP_HOST="evil.example.net")
    assert refused.status_code == 400


def test_printable_escapes_terminal_control_characters():
    assert printable("gpu-\x1b[31mred\x1b[0m\x07\x9b") == "gpu-\\x1b[31mred\\x1b[0m\\x07\\u009b"
    assert printable("ünïcode ✓ tab\tok") == "ünïcode ✓ tab\\x09ok"


@pytest.mark.django_db
def test_list_workers_shows_a_hostile_name_escaped():
    WorkerFactory(name="evil\x1b]0;owned\x07\x1b[2J", labels={"k\x1b[1m": "v"}, gpu_count=1, gpu_name="\x1b[5mGPU")
    out = StringIO()
    call_command("list_workers", stdout=out)
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()
    assert "evil\\x1b]0;owned\\x07\\x1b[2J" in out.getvalue()
