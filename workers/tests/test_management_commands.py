"""manage.py create_worker, rotate_worker_token, list_workers, drain_worker, delete_worker, create_api_token:
thin over the services."""

import os
import shlex
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from audit import actions
from audit.models import ActorType
from job_queue.tests.factories import job_on_worker
from common.humanize import ago
from workers.models import TokenKind, Worker, WorkerStatus, WorkerType
from workers.services import token_authenticate

from .factories import WorkerFactory, worker_token
from .support import audit_rows, sent_events

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    """Run a command in process; return ``(stdout, stderr)``."""
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def assert_system_actor(row, command):
    assert (row.actor_type, row.actor_id, row.actor_name) == (ActorType.SYSTEM, "", f"manage.py {command}")


# --- create_api_token ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_api_token_for_an_existing_operator_prints_a_working_token_audited_as_the_command():
    from django.contrib.auth import get_user_model

    bob = get_user_model().objects.create_user("bob", password=None, is_staff=True)

    out, err = run("create_api_token", "bob", "--description", "ci")

    plaintext = out.strip().splitlines()[-1]
    token = token_authenticate(kind=TokenKind.API, plaintext=plaintext)
    assert (token.user, token.description) == (bob, "ci")
    assert "shown once" in err and plaintext not in err
    (row,) = audit_rows(actions.API_TOKEN_CREATED)
    assert_system_actor(row, "create_api_token")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["ghost"], r"^user 'ghost' does not exist; pass --superuser to create it as an administrator \(or --group GROUP to create it in a shipped group\)$"),
        ("plain", ["plain", "--superuser"], "^user 'plain' exists and is not a superuser; refusing to promote it$"),
    ],
)
def test_create_api_token_errors_are_one_line_and_issue_nothing(setup, args, message):
    from django.contrib.auth import get_user_model

    if setup:
        get_user_model().objects.create_user(setup, password=None)

    with pytest.raises(CommandError, match=message):
        run("create_api_token", *args)

    assert audit_rows() == []
    assert not get_user_model().objects.filter(is_superuser=True).exists()


# --- create_worker -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_worker_prints_id_token_and_agent_command_line():
    out, _ = run("create_worker", "gpu-1", "--label", "gpu=a100", "--label", "region = eu-west")

    worker = Worker.objects.get(name="gpu-1")
    assert (worker.worker_type, worker.status) == (WorkerType.PERSISTENT, WorkerStatus.CONNECTING)
    assert worker.labels == {"gpu": "a100", "region": "eu-west"}
    lines = out.splitlines()
    assert f"Worker id: {worker.pk}" in lines
    token = lines[2].rsplit(" ", 1)[1]
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=token).worker_id == worker.pk
    command = lines[-1].strip()
    assert command == (
        f"SIMPLETUNER_WORKER_TOKEN={token} .venv/bin/simpletuner worker "
        "--orchestrator-url http://127.0.0.1:8001 --name gpu-1 --persistent"
    )
    (row,) = audit_rows(actions.WORKER_CREATED)
    assert_system_actor(row, "create_worker")
    assert (row.target_id, row.details["labels"]) == (worker.pk, {"gpu": "a100", "region": "eu-west"})
    assert row.details["token_prefix"] == token[:10]


@pytest.mark.django_db
def test_create_ephemeral_worker_agent_line_quotes_and_omits_persistent():
    out, _ = run("create_worker", "eph 2", "--type", "ephemeral", "--orchestrator-url", "https://orch.example:8443")

    worker = Worker.objects.get(name="eph 2")
    assert worker.worker_type == WorkerType.EPHEMERAL
    argv = shlex.split(out.splitlines()[-1])
    assert argv[0].startswith("SIMPLETUNER_WORKER_TOKEN=wt_")
    assert argv[1:] == [".venv/bin/simpletuner", "worker", "--orchestrator-url", "https://orch.example:8443", "--name", "eph 2"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, message",
    [
        (["--label", "gpu"], "bad label 'gpu': expected KEY=VALUE"),
        (["--label", "=a100"], "bad label '=a100': expected KEY=VALUE"),
        (["--label", "a=1", "--label", "a=2"], "label 'a' given twice"),
        (["--type", "local"], "unknown worker type 'local': expected persistent or ephemeral"),
    ],
)
def test_create_worker_bad_arguments_are_one_line_errors_and_create_nothing(args, message):
    with pytest.raises(CommandError, match=message) as raised:
        run("create_worker", "gpu-1", *args)

    assert "\n" not in str(raised.value)
    assert not Worker.objects.exists()
    assert audit_rows() == []


@pytest.mark.django_db
def test_create_worker_with_a_taken_name_is_the_services_conflict():
    WorkerFactory(name="gpu-1")

    with pytest.raises(CommandError, match="^a worker named 'gpu-1' already exists$"):
        run("create_worker", "gpu-1")

    assert Worker.objects.count() == 1


# --- rotate_worker_token -------------------------------------------------------------------------


@pytest.mark.django_db
def test_rotate_worker_token_by_name_prints_the_new_token_and_revokes_the_old(commit):
    worker = WorkerFactory(name="gpu-1")
    old = worker_token(worker)

    with commit():
        out, err = run("rotate_worker_token", "gpu-1")

    new = out.strip()
    assert out == new + "\n" and new.startswith("wt_")
    assert "shown once" in err
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=old) is None
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=new).worker_id == worker.pk
    (row,) = audit_rows(actions.WORKER_TOKEN_ROTATED)
    assert_system_actor(row, "rotate_worker_token")
    assert (row.target_id, row.details["revoked_tokens"]) == (worker.pk, 1)


@pytest.mark.django_db
def test_rotate_worker_token_of_an_unknown_worker():
    with pytest.raises(CommandError, match="^no worker with id or name 'nope'$"):
        run("rotate_worker_token", "nope")


# --- worker look-up by id or name ----------------------------------------------------------------


@pytest.mark.django_db
def test_worker_is_found_by_id_as_well_as_by_name():
    worker = WorkerFactory(name="gpu-1", offline=True)

    out, _ = run("delete_worker", worker.pk)

    assert out == f"Deleted worker gpu-1 ({worker.pk}).\n"
    assert not Worker.objects.exists()


@pytest.mark.django_db
def test_a_value_that_is_one_workers_id_and_anothers_name_is_refused():
    first = WorkerFactory(name="first", offline=True)
    second = WorkerFactory(name=first.pk, offline=True)

    with pytest.raises(CommandError, match=f"is both the id of worker 'first' and the name of worker {second.pk}"):
        run("delete_worker", first.pk)

    assert Worker.objects.count() == 2
    run("delete_worker", "first")  # the way out the message names
    assert list(Worker.objects.all()) == [second]


# --- list_workers --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_list_workers_prints_a_table():
    busy = WorkerFactory(name="a-busy", gpu_count=2, gpu_name="NVIDIA H100", labels={"region": "eu", "gpu": "h100"})
    job = job_on_worker(busy)
    Worker.objects.filter(pk=busy.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=12))
    fresh = WorkerFactory(name="b-fresh", fresh=True, worker_type=WorkerType.EPHEMERAL)

    out, _ = run("list_workers")

    header, first, second = out.splitlines()
    assert header.split() == ["ID", "NAME", "TYPE", "STATUS", "GPUS", "LABELS", "JOB", "HEARTBEAT"]
    assert first.startswith(f"{busy.pk}  a-busy   persistent  busy ")
    assert "2 × NVIDIA H100" in first and "gpu=h100,region=eu" in first and job.pk in first
    assert first.endswith(" s ago") and first.rsplit(None, 3)[1] in ("12", "13")
    assert second.split() == [fresh.pk, "b-fresh", "ephemeral", "connecting", "-", "-", "-", "never"]
    # Columns line up: every cell of a column starts where its header does.
    assert first.index("a-busy") == second.index("b-fresh") == header.index("NAME")
    assert first.index(job.pk) == header.index("JOB")


@pytest.mark.django_db
def test_list_workers_filters_by_status():
    WorkerFactory(name="idle")
    WorkerFactory(name="busy", status=WorkerStatus.BUSY)
    WorkerFactory(name="gone", offline=True)

    out, _ = run("list_workers", "--status", "idle, offline")

    assert [line.split()[1] for line in out.splitlines()[1:]] == ["gone", "idle"]
    assert run("list_workers", "--status", "draining")[0] == "No workers with status draining.\n"


@pytest.mark.django_db
def test_list_workers_without_workers():
    assert run("list_workers")[0] == "No workers.\n"


@pytest.mark.django_db
@pytest.mark.parametrize("value, named", [("idle,bogus", "bogus"), ("Idle", "Idle"), (",", "','")])
def test_list_workers_unknown_status_is_an_error(value, named):
    with pytest.raises(CommandError, match=f"^unknown status {named}: expected one or more of connecting, idle"):
        run("list_workers", "--status", value)


def test_ago():
    now = timezone.now()
    assert ago(None, now) == "never"
    assert ago(now - timedelta(seconds=12.7), now) == "12 s ago"
    assert ago(now + timedelta(seconds=3), now) == "0 s ago"  # a clock a little ahead
    assert ago(now - timedelta(minutes=5), now) == "5 min ago"
    assert ago(now - timedelta(hours=3), now) == "3 h ago"
    assert ago(now - timedelta(days=4), now) == "4 d ago"


# --- drain_worker --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_drain_worker_drains_and_tells_the_agent(commit):
    worker = WorkerFactory(name="gpu-1")
    job = job_on_worker(worker)

    with commit():
        out, _ = run("drain_worker", "gpu-1")

    assert out == f"Worker gpu-1 ({worker.pk}) is draining; it finishes job {job.pk} and takes no new one.\n"
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.DRAINING and worker.drain_requested_at is not None
    (requested,) = audit_rows(actions.WORKER_DRAIN_REQUESTED)
    (changed,) = audit_rows(actions.WORKER_STATUS_CHANGED, target_id=worker.pk)
    assert_system_actor(requested, "drain_worker")
    assert_system_actor(changed, "drain_worker")
    assert changed.details == {"from": "busy", "to": "draining", "reason": "drain requested"}
    assert [e["type"] for e in sent_events(worker.pk)][-1] == "drain"

    # Again: idempotent, nothing more audited.
    run("drain_worker", worker.pk)
    assert len(audit_rows(actions.WORKER_DRAIN_REQUESTED)) == 1


@pytest.mark.django_db
def test_drain_an_offline_worker():
    worker = WorkerFactory(name="gpu-1", offline=True)

    out, _ = run("drain_worker", "gpu-1")

    assert out == f"Worker gpu-1 ({worker.pk}) is offline; it comes back draining.\n"
    worker.refresh_from_db()
    assert (worker.status, worker.is_draining) == (WorkerStatus.OFFLINE, True)


@pytest.mark.django_db
def test_drain_an_unknown_worker():
    with pytest.raises(CommandError, match="^no worker with id or name 'nope'$"):
        run("drain_worker", "nope")


# --- delete_worker -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_delete_an_offline_worker():
    worker = WorkerFactory(name="gpu-1", offline=True, labels={"gpu": "a100"})

    out, _ = run("delete_worker", "gpu-1")

    assert out == f"Deleted worker gpu-1 ({worker.pk}).\n"
    assert not Worker.objects.exists()
    (row,) = audit_rows(actions.WORKER_DELETED)
    assert_system_actor(row, "delete_worker")
    assert (row.target_id, row.details["name"], row.details["labels"]) == (worker.pk, "gpu-1", {"gpu": "a100"})


@pytest.mark.django_db
@pytest.mark.parametrize("status", [WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.DRAINING])
def test_delete_an_online_worker_is_refused_with_the_services_message(status):
    WorkerFactory(name="gpu-1", status=status)

    with pytest.raises(CommandError) as raised:
        run("delete_worker", "gpu-1")

    assert str(raised.value) == (
        f"worker gpu-1 is {status}; only an offline worker can be deleted (drain it and stop its agent first)"
    )
    assert Worker.objects.filter(name="gpu-1").exists()
    assert audit_rows(actions.WORKER_DELETED) == []


# --- as a real process ---------------------------------------------------------------------------


def test_manage_py_errors_exit_1_with_one_line_on_stderr(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
    env["SIMPLETUNER_DATA_DIR"] = str(tmp_path)

    def manage(*args):
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    migrated = manage("migrate", "--noinput", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr

    missing = manage("delete_worker", "nope")
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr.splitlines() == ["CommandError: no worker with id or name 'nope'"]

    bad_label = manage("create_worker", "gpu-1", "--label", "gpu")
    assert (bad_label.returncode, bad_label.stdout) == (1, "")
    assert bad_label.stderr.splitlines() == [
        "CommandError: bad label 'gpu': expected KEY=VALUE, e.g. --label gpu=a100"
    ]
