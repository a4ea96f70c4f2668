"""The submit-and-dispatch hot path: one commit, few statements, labels pre-filtered in SQL, same choices."""

from unittest import mock

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit import actions
from audit.models import AuditEvent
from audit.services import Actor
from job_queue import dispatch
from job_queue.models import JobStatus
from job_queue.services import job_submit
from workers.models import WorkerStatus
from workers.tests.factories import UserFactory, WorkerFactory

OPERATOR_NAME = "alice"


@pytest.fixture
def actor():
    return Actor.for_user(UserFactory(username=OPERATOR_NAME), "10.0.0.5")


@pytest.mark.django_db(transaction=True)
def test_a_dispatching_submit_commits_once_with_its_audit_rows(actor):
    # steady state: the audit chain's head row and the worker's event channel exist (a first submit makes them)
    WorkerFactory(name="warm-up")
    job_submit(config_name="c", actor=actor)
    worker = WorkerFactory()
    commits = mock.patch.object(connection, "commit", wraps=connection.commit)
    with commits as counted, CaptureQueriesContext(connection) as queries:
        job, dispatched = job_submit(config_name="c", actor=actor)

    assert dispatched and job.status == JobStatus.DISPATCHED and job.worker_id == worker.pk
    statements = [q["sql"] for q in queries.captured_queries]
    first_event = next(i for i, sql in enumerate(statements) if "django_eventstream" in sql)
    ours = statements[:first_event]
    # Two commits: the job, its dispatch and every audit row in one transaction; then, after it, the
    # event library storing the job_submit it publishes (events leave on commit).
    assert counted.call_count == 2
    assert any(sql.startswith('INSERT INTO "queue_job"') for sql in ours)
    assert any(sql.startswith('UPDATE "queue_job"') for sql in ours)
    assert any(sql.startswith('INSERT INTO "audit_auditevent"') for sql in ours)
    assert not any("queue_job" in sql or "audit_" in sql for sql in statements[first_event:])
    # the submission and the dispatch are both on the audit chain, in that order
    assert list(AuditEvent.objects.filter(target_id=job.pk).order_by("seq").values_list("action", flat=True)[:1]) == [
        actions.JOB_SUBMITTED
    ]
    assert AuditEvent.objects.filter(target_id=job.pk, action=actions.JOB_DISPATCHED).count() == 1
    # a guard against the statement count creeping back (before issue 13: 3 transactions; BEGIN and
    # COMMIT count on PostgreSQL: 12 now, one of them the stored-config lookup of issue 15; a first
    # attempt looks up no checkpoint to resume from)
    assert len(ours) <= 12, "\n".join(ours)
    assert not any("artifacts_checkpoint" in sql for sql in ours)
    assert not any(sql.startswith("DECLARE") for sql in statements)  # no server-side cursor for the candidates
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.BUSY and worker.current_job_id == job.pk


@pytest.mark.django_db
def test_exact_label_selectors_are_matched_in_sql_and_globs_in_python(commit, actor):
    WorkerFactory(name="a", labels={"team": "vision", "zone.eu/x__y": "1"})
    b = WorkerFactory(name="b", labels={"team": "nlp", "zone.eu/x__y": "2"})
    narrowed = dispatch._with_exact_labels(dispatch._available_workers(), {"team": "nlp", "zone.eu/x__y": "2"})
    assert list(narrowed.values_list("name", flat=True)) == ["b"]
    # a glob is left to labels_match: the pre-filter keeps every worker
    assert dispatch._with_exact_labels(dispatch._available_workers(), {"team": "n*"}).count() == 2
    # a pattern that only looks like text in SQL (case differs) matches nothing, as labels_match says
    assert not dispatch._with_exact_labels(dispatch._available_workers(), {"team": "NLP"}).exists()

    with commit():
        job, dispatched = job_submit(config_name="c", actor=actor, worker_labels={"team": "n?p", "zone.eu/x__y": "2"})
    assert dispatched and job.worker_id == b.pk


@pytest.mark.django_db
def test_candidates_past_the_first_batch_are_still_tried(commit, actor, monkeypatch):
    monkeypatch.setattr(dispatch, "CANDIDATE_BATCH", 2)
    for i in range(5):
        WorkerFactory(name=f"cpu-{i}", labels={"gpu": "none"})
    fitting = WorkerFactory(name="gpu", labels={"gpu": "a100"})
    with commit():
        job, dispatched = job_submit(config_name="c", actor=actor, worker_labels={"gpu": "a1*"})  # a glob: no pre-filter
    assert dispatched and job.worker_id == fitting.pk


@pytest.mark.django_db
def test_a_submit_that_finds_no_worker_commits_the_queued_job(actor):
    job, dispatched = job_submit(config_name="c", actor=actor, worker_labels={"team": "nobody"})
    assert not dispatched
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and job.worker_id is None
