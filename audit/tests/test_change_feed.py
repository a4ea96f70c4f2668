"""The operators' change feed (audit writes announce their workers and jobs on commit) and the fleet overview."""

import re
from datetime import timedelta

import pytest
from django.db import transaction
from django.http import StreamingHttpResponse
from django.utils import timezone

from realtime.operator_feed import CHANGES, MAX_TARGETS
from audit.services import Actor
from job_queue.models import JobStatus
from job_queue.services import job_cancel, job_submit
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Worker, WorkerStatus
from workers.services import api_token_create, worker_drain
from job_queue.sweeps import sweep_stale_workers
from workers.tests.factories import UserFactory, WorkerFactory
from workers.tests.support import admin_url

FEED = "/admin/live/changes"
OPERATOR = Actor.system("test")


def changes(*targets):
    """The ``changes`` event naming ``targets`` (objects), as the feed sends it."""
    named = sorted((obj._meta.model_name, obj.pk) for obj in targets)
    return {"type": CHANGES, "many": False, "targets": [{"type": kind, "id": pk} for kind, pk in named]}


# --- what is announced ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_transaction_announces_its_targets_once(commit, operator_changes):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    with commit():
        # Several audit rows about the job and its worker (cancel requested, status changed...).
        job_cancel(job_id=job.pk, actor=OPERATOR)

    assert operator_changes == [changes(job)]

    with commit():
        worker_drain(worker_id=worker.pk, actor=OPERATOR)  # drain requested + status changed: one worker

    assert operator_changes[1:] == [changes(worker)]


@pytest.mark.django_db
def test_a_submission_dispatched_at_once_names_the_job_and_its_worker(commit, operator_changes):
    worker = WorkerFactory()

    with commit():
        job, dispatched = job_submit(config_name="c", actor=OPERATOR)

    assert dispatched
    assert operator_changes == [changes(job, worker)]


@pytest.mark.django_db(transaction=True)
def test_each_committed_transaction_announces_once_with_real_commits(operator_changes):
    # No test transaction around it: job_submit commits once (the submission and its dispatch), then a
    # second transaction (a drain) commits on its own.
    worker = WorkerFactory()

    job, dispatched = job_submit(config_name="c", actor=OPERATOR)
    worker_drain(worker_id=worker.pk, actor=OPERATOR)

    assert dispatched
    assert operator_changes == [changes(job, worker), changes(worker)]


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_announces_nothing(operator_changes):
    worker = WorkerFactory()

    with pytest.raises(RuntimeError), transaction.atomic():
        worker_drain(worker_id=worker.pk, actor=OPERATOR)
        raise RuntimeError("something after the drain failed")

    assert operator_changes == []
    worker.refresh_from_db()
    assert worker.drain_requested_at is None


@pytest.mark.django_db
def test_audited_changes_to_other_things_are_not_announced(commit, operator_changes):
    with commit():
        api_token_create(user=UserFactory(), actor=OPERATOR)

    assert operator_changes == []


@pytest.mark.django_db
@pytest.mark.parametrize(("stale", "many"), [(MAX_TARGETS, False), (MAX_TARGETS + 1, True)])
def test_a_sweep_over_more_than_a_hundred_targets_says_many(commit, operator_changes, stale, many):
    silent = WorkerFactory.create_batch(stale, last_heartbeat=timezone.now() - timedelta(hours=1))
    WorkerFactory()  # heard from: stays idle

    with commit():
        assert sweep_stale_workers()["workers"] == stale

    assert Worker.objects.filter(status=WorkerStatus.OFFLINE).count() == stale
    (event,) = operator_changes
    if many:
        assert event == {"type": CHANGES, "many": True, "targets": []}
    else:
        assert event == changes(*silent)


# --- GET /admin/live/changes ----------------------------------------------------------------------


# Real commits: the feed reads the session and user in a thread of its own, on a connection of its own.
live_feed = pytest.mark.django_db(transaction=True)


@live_feed
def test_the_feed_refuses_anonymous_with_json(client):
    response = client.get(FEED)

    assert response.status_code == 401
    assert response.json() == {"code": "not_authenticated", "detail": "sign in to the admin to follow changes"}


@live_feed
@pytest.mark.parametrize(
    "user", [{"is_staff": False, "permissions": ["workers.view_worker"]}, {"is_staff": True}], ids=["not-staff", "no-view"]
)
def test_the_feed_refuses_a_user_who_may_not_follow_it(client, user):
    client.force_login(UserFactory(**user))

    response = client.get(FEED)

    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"


@live_feed
@pytest.mark.parametrize("permission", ["workers.view_worker", "queue.view_job", "audit.view_auditevent"])
def test_the_feed_streams_to_staff_who_may_view_what_it_names(client, permission):
    client.force_login(UserFactory(is_staff=True, permissions=[permission]))

    response = client.get(FEED)  # the stream is never read: it would not end

    assert response.status_code == 200
    assert isinstance(response, StreamingHttpResponse)
    assert response["Content-Type"] == "text/event-stream"
    assert response["Cache-Control"] == "no-cache"


@live_feed
def test_the_feed_takes_only_get(client):
    client.force_login(UserFactory(is_staff=True, is_superuser=True))

    assert client.post(FEED).status_code == 405


# --- the fleet overview on the admin index ---------------------------------------------------------


def _counts(text):
    return {name: int(n) for name, n in re.findall(r'data-count="([^"]+)">(\d+)<', text)}


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/admin/", "/admin/live/overview/"])
def test_the_overview_counts_workers_and_jobs_and_shows_recent_failures(admin_client, url):
    WorkerFactory.create_batch(2)
    WorkerFactory(offline=True)
    job_on_worker(WorkerFactory(), status=JobStatus.RUNNING)
    job_on_worker(WorkerFactory(), status=JobStatus.DISPATCHED)
    JobFactory.create_batch(3)
    JobFactory(status=JobStatus.COMPLETED)
    now = timezone.now()
    failures = [
        JobFactory(
            status=JobStatus.FAILED, last_error=f"error number {n}", finished_at=now - timedelta(minutes=n),
            worker_name="gpu-box-1",
        )
        for n in range(7)
    ]  # fmt: skip
    escaped = JobFactory(id="j_22aabbccddee0011", status=JobStatus.FAILED, last_error="CUDA <oom>", finished_at=now)

    response = admin_client.get(url)

    assert response.status_code == 200
    text = response.content.decode()
    assert _counts(text) == {
        "workers-connecting": 0,
        "workers-idle": 2,
        "workers-busy": 2,
        "workers-draining": 0,
        "workers-offline": 1,
        "jobs-queued": 3,
        "jobs-running": 2,
        # one GPU each (the factory's): the two idle workers' are free, the two holding a job's busy
        "gpus-total": 4,
        "gpus-free": 2,
        "gpus-busy": 2,
    }
    shown = re.findall(r"error number (\d)", text)
    assert shown == ["0", "1", "2", "3"]  # the five newest, newest first (with the escaped one)
    assert "CUDA &lt;oom&gt;" in text
    assert all(f">{job.config_name}</a>" not in text for job in failures[4:])
    link = re.search(rf'<a href="([^"]+)">{escaped.config_name}</a>', text).group(1)
    assert link == admin_url(escaped)
    assert admin_client.get(link).context["original"] == escaped


@pytest.mark.django_db
def test_the_index_holds_the_overview_and_the_fragment_is_only_the_overview(admin_client):
    index = admin_client.get("/admin/").content.decode()
    fragment = admin_client.get("/admin/live/overview/").content.decode()

    assert '<div data-live-fragment="/admin/live/overview/" id="fleet-overview">' in index
    assert "Fleet at a glance" in index and "Fleet at a glance" in fragment
    assert "<html" in index and "<html" not in fragment


@pytest.mark.django_db
def test_the_overview_fragment_needs_a_signed_in_staff_user(client):
    response = client.get("/admin/live/overview/")

    assert response.status_code == 302 and "/admin/login/" in response["Location"]



# --- review fixes: resume hints, permissions, the background publisher ------------------------------


@live_feed
@pytest.mark.parametrize(
    "hints",
    [
        {"HTTP_LAST_EVENT_ID": "worker-w_1:0"},
        {"QUERY_STRING": "es-meta=x&channel=worker-w_1"},
        {"QUERY_STRING": "recover=true&link=next"},
    ],
    ids=["worker-channel-id", "meta-and-channel", "recover-and-link"],  # a malformed id: realtime/tests/test_last_event_id.py
)
def test_resume_hints_and_channel_picks_are_ignored_on_the_unstored_feed(client, hints):
    client.force_login(UserFactory(is_staff=True, permissions=["workers.view_worker"]))

    response = client.get(FEED, **hints)

    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"


@pytest.mark.django_db
def test_the_overview_shows_only_what_the_user_may_view(client):
    JobFactory(status=JobStatus.FAILED, last_error="secret CUDA trace")
    WorkerFactory()
    client.force_login(UserFactory(is_staff=True, permissions=["workers.view_worker"]))

    body = client.get("/admin/live/overview/").content.decode()

    assert "Workers" in body
    assert "secret CUDA trace" not in body and "Recent failures" not in body


@pytest.mark.django_db
def test_a_staff_user_who_may_not_follow_the_feed_gets_no_live_meta(client):
    client.force_login(UserFactory(is_staff=True))

    assert 'name="simpletuner-live"' not in client.get("/admin/").content.decode()


def test_with_redis_the_feed_is_published_in_the_background_and_merged(monkeypatch):
    import threading

    from realtime import operator_feed as feed
    from django_eventstream import eventstream

    monkeypatch.setattr(eventstream, "redis_client", object())  # as when EVENTSTREAM_REDIS is configured
    monkeypatch.setattr(feed, "_publisher", feed._BackgroundPublisher())
    gate, entered, sent, done = threading.Event(), threading.Event(), [], threading.Event()

    def slow_send(data):  # a Redis that hangs until the gate opens
        entered.set()
        gate.wait(10)
        sent.append(data)
        if sum(len(d["targets"]) for d in sent) >= 3:
            done.set()

    monkeypatch.setattr(feed, "_send_now", slow_send)

    feed.publish(feed.changes_payload([("job", "j_1")]))  # returns at once: the thread is stuck on it
    assert entered.wait(10)
    feed.publish(feed.changes_payload([("worker", "w_1")]))
    feed.publish(feed.changes_payload([("worker", "w_2")]))
    gate.set()

    assert done.wait(10)
    assert sent[0]["targets"] == [{"type": "job", "id": "j_1"}]
    assert sent[1]["targets"] == [{"type": "worker", "id": "w_1"}, {"type": "worker", "id": "w_2"}]  # merged
