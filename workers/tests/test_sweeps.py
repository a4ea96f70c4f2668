"""The health sweep (stale workers go offline, their jobs recovered by the retry rules) and the ephemeral cleanup."""

import logging
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit import actions
from audit.models import AuditEvent
from audit.tests.support import audit_insert_statements
from job_queue.models import AttemptOutcome, Job, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from realtime import publish
from workers import tasks
from workers.models import Token, Worker, WorkerStatus, WorkerType
from job_queue.sweeps import sweep_stale_workers
from workers.sweeps import sweep_offline_ephemeral_workers

from .factories import WorkerFactory, worker_token
from .support import audit_rows

pytestmark = pytest.mark.django_db


def stale(**kwargs):
    return WorkerFactory(last_heartbeat=timezone.now() - timedelta(seconds=600), **kwargs)


def test_fresh_workers_are_left_alone():
    worker = WorkerFactory()
    assert sweep_stale_workers() == {"workers": 0, "requeued": 0, "failed": 0}
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.IDLE


def test_stale_workers_go_offline_draining_ones_included_and_are_audited():
    idle, draining = stale(), stale(draining=True)
    result = sweep_stale_workers()
    assert result["workers"] == 2
    assert set(Worker.objects.values_list("status", flat=True)) == {WorkerStatus.OFFLINE}
    rows = AuditEvent.objects.filter(action="worker.status_changed", target_id__in=[idle.pk, draining.pk])
    assert {(r.target_id, r.details["from"], r.details["to"]) for r in rows} == {
        (idle.pk, "idle", "offline"),
        (draining.pk, "draining", "offline"),
    }
    # The drain intent survives going offline: the worker comes back draining.
    assert Worker.objects.get(pk=draining.pk).drain_requested_at is not None


def test_running_job_is_requeued_spending_a_retry_and_goes_to_the_next_idle_worker(django_capture_on_commit_callbacks):
    lost = stale()
    job = job_on_worker(lost, status=JobStatus.RUNNING)
    spare = WorkerFactory()
    with django_capture_on_commit_callbacks(execute=True):
        result = sweep_stale_workers()
    assert result == {"workers": 1, "requeued": 1, "failed": 0}
    job.refresh_from_db()
    assert job.retry_count == 1
    assert job.status == JobStatus.DISPATCHED and job.worker_id == spare.pk
    assert job.attempts.get(number=1).outcome == AttemptOutcome.LOST
    assert Worker.objects.get(pk=lost.pk).current_job_id is None
    assert AuditEvent.objects.filter(action="job.requeued", target_id=job.pk, details__retry_spent=True).exists()


def test_unacknowledged_dispatch_is_requeued_without_spending_a_retry():
    job = job_on_worker(stale(), status=JobStatus.DISPATCHED)
    sweep_stale_workers()
    job.refresh_from_db()
    assert (job.status, job.retry_count, job.worker_id, job.lease_id) == (JobStatus.QUEUED, 0, None, None)
    assert job.attempts.get().outcome == AttemptOutcome.UNACKNOWLEDGED


def test_job_out_of_retries_fails_for_good_with_the_reason():
    job = job_on_worker(stale(), status=JobStatus.RUNNING, retry_count=3, max_retries=3)
    assert sweep_stale_workers()["failed"] == 1
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "retries exhausted" in job.last_error and job.finished_at is not None


def test_other_jobs_are_untouched():
    queued = JobFactory()
    done = JobFactory(status=JobStatus.COMPLETED)
    sweep_stale_workers()
    assert Job.objects.get(pk=queued.pk).status == JobStatus.QUEUED
    assert Job.objects.get(pk=done.pk).status == JobStatus.COMPLETED


def test_sweep_cost_does_not_grow_with_the_fleet(django_assert_num_queries):
    for _ in range(30):
        job_on_worker(stale(), status=JobStatus.RUNNING)
    # A fixed number of statements, whatever the number of stale workers and jobs: the savepoint and its
    # release, three SELECTs, one UPDATE each of workers, attempts and jobs; then the 90 audit rows' INSERT
    # (one on PostgreSQL; on SQLite one per Django batch of 83 rows). Before the audit chain was sealed
    # after commit, the chain's head was also locked and moved: 11 at most. And one read of the active webhooks
    # (webhooks.staging: the deliveries of workers offline and jobs requeued), whatever their number.
    expected = audit_insert_statements(90)
    with django_assert_num_queries(9 + expected) as captured:
        assert sweep_stale_workers()["workers"] == 30
    inserts = [q for q in captured.captured_queries if 'INSERT INTO "audit_auditevent"' in q["sql"]]
    assert len(inserts) == expected


# --- ephemeral cleanup ----------------------------------------------------------------------------


def gone_ephemeral(offline_for=timedelta(hours=2), **kwargs):
    """Return an ephemeral worker offline for ``offline_for``, with a token."""
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL, offline=True, **kwargs)
    Worker.objects.filter(pk=worker.pk).update(status_changed_at=timezone.now() - offline_for)
    worker_token(worker)
    worker.refresh_from_db()
    return worker


def test_ephemeral_workers_offline_for_longer_than_the_setting_are_deleted_with_their_tokens():
    doomed = gone_ephemeral()
    kept = [
        gone_ephemeral(offline_for=timedelta(minutes=50)),  # not long enough
        WorkerFactory(worker_type=WorkerType.PERSISTENT, offline=True),  # persistent workers stay
        WorkerFactory(worker_type=WorkerType.EPHEMERAL),  # online
    ]
    Worker.objects.filter(pk=kept[1].pk).update(status_changed_at=timezone.now() - timedelta(days=3))
    idle_long = WorkerFactory(worker_type=WorkerType.EPHEMERAL)  # idle for a long time, but heartbeating
    Worker.objects.filter(pk=idle_long.pk).update(status_changed_at=timezone.now() - timedelta(days=3))

    assert sweep_offline_ephemeral_workers() == {"workers": 1}

    assert not Worker.objects.filter(pk=doomed.pk).exists()
    assert not Token.objects.filter(worker_id=doomed.pk).exists()
    assert set(Worker.objects.values_list("pk", flat=True)) == {w.pk for w in kept} | {idle_long.pk}
    (deleted,) = audit_rows(actions.WORKER_DELETED)
    assert (deleted.target_id, deleted.actor_type, deleted.actor_name) == (doomed.pk, "system", "ephemeral-cleanup")
    assert deleted.details["reason"] == "ephemeral cleanup"
    assert (deleted.details["name"], deleted.details["worker_type"]) == (doomed.name, "ephemeral")


def test_the_cleanup_age_is_the_setting(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "EPHEMERAL_CLEANUP_AFTER": 60}
    worker = gone_ephemeral(offline_for=timedelta(minutes=2))

    assert sweep_offline_ephemeral_workers() == {"workers": 1}
    assert not Worker.objects.filter(pk=worker.pk).exists()


def test_deleted_worker_keeps_its_audit_trail_and_job_history():
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL)
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    sweep_stale_workers(now=timezone.now() + timedelta(hours=1))  # the spot instance vanished
    Job.objects.filter(pk=job.pk).update(status=JobStatus.COMPLETED)
    before = {e.pk for e in audit_rows(target_id=worker.pk)}
    assert before  # it went offline, audited

    assert sweep_offline_ephemeral_workers(now=timezone.now() + timedelta(hours=3)) == {"workers": 1}

    assert {e.pk for e in audit_rows(target_id=worker.pk)} == before | {audit_rows(actions.WORKER_DELETED)[0].pk}
    job.refresh_from_db()
    assert (job.worker_id, job.worker_name) == (None, worker.name)
    (attempt,) = job.attempts.all()
    assert (attempt.worker_id, attempt.worker_name, attempt.outcome) == (None, worker.name, AttemptOutcome.LOST)


def test_an_offline_worker_that_still_holds_a_job_is_kept():
    worker = gone_ephemeral()
    job = JobFactory(status=JobStatus.RUNNING)
    Worker.objects.filter(pk=worker.pk).update(current_job=job)

    assert sweep_offline_ephemeral_workers() == {"workers": 0}
    assert Worker.objects.filter(pk=worker.pk).exists()


def test_a_stream_still_believed_open_is_closed_on_commit(commit, control_messages):
    sent = control_messages
    with_stream = gone_ephemeral(stream_id="s-1")
    gone_ephemeral()  # no stream: nothing to close
    token_id = Token.objects.get(worker_id=with_stream.pk).pk

    with commit():
        assert sweep_offline_ephemeral_workers() == {"workers": 2}

    assert sent == [
        (
            f"_control:worker-{with_stream.pk}",
            publish.REVOKE,
            {"tokens": [publish.stream_principal_id(token_id)], "reason": "worker deleted", "code": "worker_deleted"},
        )
    ]


def test_a_deleted_workers_token_no_longer_authenticates(worker_client):
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL, offline=True)
    token = worker_token(worker)
    Worker.objects.filter(pk=worker.pk).update(status_changed_at=timezone.now() - timedelta(hours=2))
    sweep_offline_ephemeral_workers()

    response = worker_client(worker, token=token).post("/api/workers/heartbeat", {})

    assert response.status_code == 401


def test_cleanup_cost_does_not_grow_with_the_number_of_workers(django_assert_max_num_queries):
    def fleet(count):
        for _ in range(count):
            worker = gone_ephemeral()
            JobFactory(status=JobStatus.COMPLETED, worker=worker, worker_name=worker.name)

    fleet(3)
    with CaptureQueriesContext(connection) as few:
        assert sweep_offline_ephemeral_workers()["workers"] == 3
    fleet(30)
    with django_assert_max_num_queries(len(few)):
        assert sweep_offline_ephemeral_workers()["workers"] == 30
    assert not Worker.objects.exists() and not Token.objects.exists()
    assert Job.objects.filter(worker__isnull=True).count() == 33
    assert len(audit_rows(actions.WORKER_DELETED)) == 33


def test_the_celery_task_runs_the_cleanup():
    worker = gone_ephemeral()

    tasks.sweep_offline_ephemeral_workers()

    assert not Worker.objects.filter(pk=worker.pk).exists()


# --- silence counts only while a server was up to hear it ------------------------------------------


def presence(process_id, *, started_ago, seen_ago):
    from workers.presence import server_presence_beat

    now = timezone.now()
    server_presence_beat(
        process_id=process_id,
        hostname="orch-1",
        pid=1,
        started_at=now - timedelta(seconds=started_ago),
        now=now - timedelta(seconds=seen_ago),
    )


def test_a_long_running_live_server_lets_the_sweep_take_silent_workers_offline(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 120, "HEARTBEAT_INTERVAL": 30}
    presence("a", started_ago=3600, seen_ago=1)
    stale()
    assert sweep_stale_workers()["workers"] == 1


def test_no_live_server_means_the_silence_proves_nothing(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 120, "HEARTBEAT_INTERVAL": 30}
    presence("crashed", started_ago=3600, seen_ago=600)  # died 10 minutes ago; Celery beat keeps sweeping
    worker = stale()
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    assert sweep_stale_workers() == {"workers": 0, "requeued": 0, "failed": 0}
    worker.refresh_from_db()
    job.refresh_from_db()
    assert (worker.status, job.status, job.retry_count) == (WorkerStatus.BUSY, JobStatus.RUNNING, 0)


def test_after_a_restart_workers_get_a_full_timeout_to_heartbeat_again(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 120, "HEARTBEAT_INTERVAL": 30}
    presence("old", started_ago=7200, seen_ago=900)  # the server that died
    presence("new", started_ago=60, seen_ago=1)  # its restart, a minute ago
    stale()
    assert sweep_stale_workers()["workers"] == 0
    later = timezone.now() + timedelta(seconds=61)  # the new server has now been up for the whole timeout
    presence("new", started_ago=0, seen_ago=-61)
    assert sweep_stale_workers(now=later)["workers"] == 1


def test_workers_held_back_are_logged_with_the_reason(settings, caplog):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 120, "HEARTBEAT_INTERVAL": 30}
    presence("new", started_ago=60, seen_ago=1)
    caplog.set_level(logging.WARNING, logger="job_queue.sweeps")

    assert sweep_stale_workers()["workers"] == 0  # nothing stale: nothing to say
    assert caplog.messages == []
    stale()
    assert sweep_stale_workers()["workers"] == 0

    (message,) = caplog.messages
    assert message.startswith("health sweep: no worker taken offline: the orchestrator servers have been up only 6")


def test_one_server_up_all_along_is_enough_when_another_restarts(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 120, "HEARTBEAT_INTERVAL": 30}
    presence("steady", started_ago=7200, seen_ago=2)
    presence("restarted", started_ago=5, seen_ago=1)
    stale()
    assert sweep_stale_workers()["workers"] == 1


def test_presence_rows_of_processes_gone_for_a_week_are_forgotten():
    from workers.models import ServerPresence

    presence("ancient", started_ago=30 * 86400, seen_ago=8 * 86400)
    presence("now", started_ago=10, seen_ago=0)
    assert list(ServerPresence.objects.values_list("pk", flat=True)) == ["now"]


@pytest.mark.parametrize(
    "servers",
    [
        {},
        {"crashed": (3600, 600)},
        {"young": (60, 1)},
        {"steady": (3600, 1)},
        {"steady": (7200, 2), "restarted": (5, 1)},
        {"old": (7200, 900), "new": (60, 1)},
        {"exactly": (120, 1)},
    ],
)
def test_the_sweeps_condition_on_presence_agrees_with_the_reason_they_log(settings, servers):
    from workers.models import ServerPresence
    from workers.selectors import servers_heard_silence, servers_silent_reason

    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_INTERVAL": 30}
    for process_id, (started_ago, seen_ago) in servers.items():
        presence(process_id, started_ago=started_ago, seen_ago=seen_ago)
    now = timezone.now()
    worker = WorkerFactory()

    heard = Worker.objects.filter(servers_heard_silence(now=now, timeout=120), pk=worker.pk).exists()

    assert ServerPresence.objects.count() == len(servers)
    assert heard == (servers_silent_reason(now=now, timeout=120) is None)
