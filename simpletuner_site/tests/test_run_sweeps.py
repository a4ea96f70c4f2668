"""manage.py run_sweeps: every sweep of the schedule, once (--once) or on its interval until Ctrl-C."""

import signal
import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from audit.models import AuditEvent
from job_queue.models import Job, JobAttempt, JobStatus
from job_queue.tests.factories import job_on_worker
from simpletuner_site.management.commands import run_sweeps
from workers.models import Worker, WorkerStatus, WorkerType

from workers.tests.factories import WorkerFactory

LONG_AGO = timedelta(hours=2)


def run(*args):
    out, err = StringIO(), StringIO()
    call_command("run_sweeps", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.mark.django_db
def test_once_runs_every_sweep_and_prints_what_each_did():
    then = timezone.now() - LONG_AGO
    stale = WorkerFactory(last_heartbeat=then)
    lost = job_on_worker(WorkerFactory(), status=JobStatus.DISPATCHED)
    Job.objects.filter(pk=lost.pk).update(dispatched_at=then)
    gone = WorkerFactory(worker_type=WorkerType.EPHEMERAL, offline=True)
    Worker.objects.filter(pk=gone.pk).update(status_changed_at=then)

    out, _ = run("--once")

    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "queue.sweep_stale_workers",
        "queue.sweep_unacknowledged_dispatches",
        "workers.sweep_offline_ephemeral_workers",
        "queue.dispatch_pending",
        "artifacts.sweep_expired_artifacts",
        "realtime.trim_stored_events",
        "audit.seal_chain",
        "webhooks.deliver_due",
        "webhooks.trim_deliveries",
        "queue.sweep_fairshare_charge",
    ]
    assert lines[0].startswith("queue.sweep_stale_workers: workers=1 requeued=0 failed=0 (")
    assert lines[1].startswith("queue.sweep_unacknowledged_dispatches: jobs=1 workers_freed=1 (")
    assert lines[2].startswith("workers.sweep_offline_ephemeral_workers: workers=1 (")
    # dispatch_pending finds the job requeued just before (sweeps commit as they go) and the freed worker.
    assert lines[3].startswith("queue.dispatch_pending: 1 (")
    # every audit row the sweeps wrote (offline, requeued, freed, deleted, dispatched...) sealed last
    assert lines[6].startswith(f"audit.seal_chain: sealed={AuditEvent.objects.count()} (")
    assert AuditEvent.objects.filter(seq__isnull=True).count() == 0
    assert Worker.objects.get(pk=stale.pk).status == WorkerStatus.OFFLINE
    assert not Worker.objects.filter(pk=gone.pk).exists()
    lost.refresh_from_db()
    assert (lost.status, lost.attempt_count, lost.retry_count) == (JobStatus.DISPATCHED, 2, 0)
    assert JobAttempt.objects.filter(job=lost).count() == 2


@pytest.mark.django_db
def test_once_runs_the_other_sweeps_when_one_fails_then_exits_with_an_error(monkeypatch):
    ran = []

    def boom():
        raise RuntimeError("database on fire")

    monkeypatch.setattr(
        run_sweeps,
        "sweep_schedule",
        lambda: [("boom", boom, 60), ("ok", lambda: ran.append("ok") or {"things": 2}, 60)],
    )
    out, err = StringIO(), StringIO()

    with pytest.raises(CommandError, match="1 sweep\\(s\\) failed: boom"):
        call_command("run_sweeps", "--once", stdout=out, stderr=err)

    assert ran == ["ok"]
    assert out.getvalue().startswith("ok: things=2 (")
    assert "boom: failed: RuntimeError: database on fire" in err.getvalue()


@pytest.mark.django_db(transaction=True)  # the scheduler closes the connections it used
def test_without_once_it_runs_each_sweep_at_once_then_on_its_interval_until_interrupted(monkeypatch):
    calls = []
    enough = threading.Event()

    def sweep():
        calls.append(threading.current_thread().name)
        if len(calls) >= 3:
            enough.set()
        return {"n": len(calls)}

    def wait_then_interrupt(self):
        assert enough.wait(10), calls
        raise KeyboardInterrupt

    monkeypatch.setattr(run_sweeps, "sweep_schedule", lambda: [("fake", sweep, 0.01)])
    monkeypatch.setattr(run_sweeps.Command, "wait_for_interrupt", wait_then_interrupt)

    out, _ = run()

    lines = out.splitlines()
    assert lines[:2] == ["fake: every 0.01 s", "Running the sweeps now, then on their intervals; Ctrl-C to stop."]
    assert lines[2].startswith("fake: n=1 (")  # right away, before the first interval
    assert calls[0] == threading.current_thread().name
    assert "embedded-sweeps" in calls[1:]  # then on the scheduler's thread
    assert lines[-1] == "Interrupted; stopping."
    assert not any(t.name == "embedded-sweeps" and t.is_alive() for t in threading.enumerate())


@pytest.mark.django_db(transaction=True)
def test_sigterm_stops_it_like_ctrl_c_and_the_previous_handler_comes_back(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def sigterm_arrives(self):
        handler = signal.getsignal(signal.SIGTERM)
        seen.append(handler)
        handler(signal.SIGTERM, None)  # what the interpreter does when the signal arrives

    monkeypatch.setattr(run_sweeps, "sweep_schedule", lambda: [("fake", lambda: 0, 60)])
    monkeypatch.setattr(run_sweeps.Command, "wait_for_interrupt", sigterm_arrives)

    out, _ = run()

    assert seen and seen[0] is not before
    assert out.splitlines()[-1] == "Interrupted; stopping."
    assert signal.getsignal(signal.SIGTERM) is before
