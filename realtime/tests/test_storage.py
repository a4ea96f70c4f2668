"""Worker events are stored in the transaction that announces them and published once, after it commits."""

import datetime
import json
import logging

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_eventstream.models import Event, EventCounter
from django_eventstream.storage import EventDoesNotExist
from django_eventstream.utils import get_storage

from audit.services import audited_atomic
from common import outbox
from job_queue.tests.test_concurrency import run_concurrently
from realtime import publish, sweeps
from realtime.storage import EventStorage
from workers import events as worker_events
from workers.tests.support import sent_events

pytestmark = pytest.mark.django_db


def stored_rows(channel):
    return list(Event.objects.filter(channel=channel).order_by("eid").values_list("eid", "type"))


def test_the_library_uses_our_storage():
    assert isinstance(get_storage(), EventStorage)


def test_an_append_outside_a_transaction_makes_the_counter_and_the_zero_placeholder_once():
    storage = get_storage()
    first = storage.append_event("worker-w_1", "ping", json.dumps({"type": "ping"}))
    second = storage.append_event("worker-w_1", "ping", json.dumps({"type": "ping"}))
    assert (first.id, second.id) == (1, 2)
    assert stored_rows("worker-w_1") == [(0, ""), (1, "ping"), (2, "ping")]
    assert EventCounter.objects.get(name="worker-w_1").value == 2
    # the library reads them back as it always did, from 0 and from a later id
    assert [e.id for e in storage.get_events("worker-w_1", 0)] == [1, 2]
    assert [(e.id, json.loads(e.data)) for e in storage.get_events("worker-w_1", 1)] == [(2, {"type": "ping"})]
    assert storage.get_current_id("worker-w_1") == 2
    with pytest.raises(EventDoesNotExist):
        storage.get_events("worker-w_1", 7)


def test_a_steady_state_append_is_two_statements_or_on_postgresql_one():
    storage = get_storage()
    storage.append_event("worker-w_2", "ping", "{}")
    with CaptureQueriesContext(connection) as queries:
        stored = storage.append_event("worker-w_2", "ping", "{}")
    statements = [q["sql"] for q in queries.captured_queries if q["sql"] not in ("BEGIN", "COMMIT", "BEGIN IMMEDIATE")]
    if connection.vendor == "postgresql":
        assert len(statements) == 1, statements
        assert statements[0].startswith("WITH counted AS (UPDATE django_eventstream_eventcounter")
        assert 'INSERT INTO "django_eventstream_event" ("channel"' in statements[0]
    else:
        assert len(statements) == 2, statements
        assert statements[0].startswith("UPDATE django_eventstream_eventcounter")
        assert statements[1].startswith('INSERT INTO "django_eventstream_event"')
    assert stored.id == 2
    assert stored_rows("worker-w_2") == [(0, ""), (1, "ping"), (2, "ping")]
    assert EventCounter.objects.get(name="worker-w_2").value == 2


def test_an_audited_transaction_stores_its_worker_events_before_it_commits_and_publishes_after(commit, pushed):
    with commit():
        with audited_atomic():
            worker_events.publish_on_commit("w_a", "ping", n=1)
            worker_events.publish_on_commit("w_a", "ping", n=2)
            assert sent_events("w_a") == []  # nothing stored yet: staged last thing before the commit
            outbox.stage_pending()
            assert [e["data"]["n"] for e in sent_events("w_a")] == [1, 2]  # stored, in the transaction
            assert pushed == []  # ...and nothing pushed before the commit
    # pushed once each after the commit, with the ids they were stored under; nothing stored twice
    assert [(channel, event.id, json.loads(event.data)["n"]) for channel, event in pushed] == [
        ("worker-w_a", 1, 1),
        ("worker-w_a", 2, 2),
    ]
    assert [e["data"]["n"] for e in sent_events("w_a")] == [1, 2]


def test_a_rolled_back_transaction_stores_and_publishes_nothing(commit, pushed):
    with commit(), pytest.raises(RuntimeError):
        with audited_atomic():
            worker_events.publish_on_commit("w_b", "ping")
            outbox.stage_pending()
            raise RuntimeError("the change fails after its event was staged")
    assert sent_events("w_b") == [] and pushed == []
    assert not EventCounter.objects.filter(name="worker-w_b").exists()


def test_an_event_of_a_savepoint_that_rolled_back_is_neither_stored_nor_published(commit, pushed):
    with commit():
        with audited_atomic():
            worker_events.publish_on_commit("w_c", "ping", n=1)
            try:
                with transaction.atomic():
                    worker_events.publish_on_commit("w_c", "ping", n=2)
                    raise RuntimeError("rolled back")
            except RuntimeError:
                pass
    assert [e["data"]["n"] for e in sent_events("w_c")] == [1]
    assert [json.loads(event.data)["n"] for _channel, event in pushed] == [1]


def test_a_transaction_that_does_not_stage_stores_its_events_after_the_commit(commit, pushed):
    with commit():
        with transaction.atomic():
            worker_events.publish_on_commit("w_d", "ping")
            assert sent_events("w_d") == []
    assert [e["type"] for e in sent_events("w_d")] == ["ping"]
    assert [event.id for _channel, event in pushed] == [1]


def test_one_transaction_locks_its_channels_in_one_order_whatever_order_it_emitted_them(commit, pushed):
    with commit():
        with audited_atomic(), CaptureQueriesContext(connection) as queries:
            for worker_id in ("w_z", "w_a", "w_m", "w_a"):
                worker_events.publish_on_commit(worker_id, "ping", to=worker_id)
    counters = [q["sql"] for q in queries.captured_queries if "UPDATE django_eventstream_eventcounter" in q["sql"]]
    locked = [next(w for w in ("w_a", "w_m", "w_z") if f"'worker-{w}'" in sql) for sql in counters]
    assert locked == sorted(locked)
    # a channel's events keep the order they were emitted in
    assert [(channel, event.id) for channel, event in pushed] == [
        ("worker-w_z", 1), ("worker-w_a", 1), ("worker-w_m", 1), ("worker-w_a", 2)
    ]


def test_a_redis_failure_on_publish_leaves_the_stored_event_for_the_streams_to_read(
    django_capture_on_commit_callbacks, monkeypatch, caplog
):
    from redis.exceptions import ConnectionError as RedisConnectionError

    class Down:
        def publish(self, *args):
            raise RedisConnectionError("Redis is down")

    monkeypatch.setattr("django_eventstream.eventstream.redis_client", Down())
    caplog.set_level(logging.WARNING, logger="realtime.publish")
    with django_capture_on_commit_callbacks(execute=True):
        with audited_atomic():
            worker_events.publish_on_commit("w_e", "ping")
    assert [e["type"] for e in sent_events("w_e")] == ["ping"]
    assert "not pushed, Redis is unreachable" in caplog.text


def test_the_trim_sweep_deletes_events_past_the_replay_window_in_batches(monkeypatch):
    storage = get_storage()
    for _ in range(5):
        storage.append_event("worker-w_f", "ping", "{}")
    old = timezone.now() - datetime.timedelta(hours=25)
    Event.objects.filter(channel="worker-w_f", eid__lte=3).update(created=old)  # the placeholder and 1-3
    monkeypatch.setattr(sweeps, "TRIM_BATCH", 2)
    assert sweeps.trim_stored_events() == {"events": 4}
    assert stored_rows("worker-w_f") == [(4, "ping"), (5, "ping")]
    assert sweeps.trim_stored_events() == {"events": 0}
    # a stream resuming from a trimmed id is reset to the current one, as with the library's own trim
    with pytest.raises(EventDoesNotExist) as reset:
        storage.get_events("worker-w_f", 2)
    assert reset.value.current_id == 5


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_transactions_give_each_channel_gapless_ids_and_never_deadlock(postgres_url):
    channels = [f"w_{i}" for i in range(4)]
    rounds = 12

    def writer(index):
        def run():
            order = channels if index % 2 else list(reversed(channels))  # opposite emit orders
            for _ in range(rounds):
                with audited_atomic():
                    for worker_id in order:
                        worker_events.publish_on_commit(worker_id, "ping", writer=index)
            return rounds

        return run

    run_concurrently([writer(i) for i in range(4)])
    for worker_id in channels:
        ids = list(Event.objects.filter(channel=publish.worker_channel(worker_id)).order_by("eid").values_list("eid", flat=True))
        assert ids == list(range(0, 4 * rounds + 1))  # the one placeholder, then every id once
        assert EventCounter.objects.get(name=publish.worker_channel(worker_id)).value == 4 * rounds
