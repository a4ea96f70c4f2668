"""The Redis event listener: it outlives a Redis outage, and every stream catches up after it resubscribes."""

import asyncio
import contextlib
import json
import logging
import socket
import time
from types import SimpleNamespace

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.test import override_settings
from django_eventstream import eventstream as es_eventstream
from django_eventstream import views as es_views
from django_eventstream.storage import DjangoModelStorage
from django_eventstream.event import Event
from django_eventstream.views import Listener, stream

from realtime import listeners, publish
from realtime import redis as realtime_redis
from realtime.db import in_db_thread
from realtime.listeners import StreamPrincipal, WorkerListenerManager
from realtime.publish import worker_channel
from realtime.redis import RedisEventListener
from worker_agent import protocol
from workers import events
from workers.models import Token, TokenKind
from workers.services import token_issue
from workers.tests.factories import WorkerFactory

from worker_agent.backoff import Backoff


class Upper:
    """A jitter source that always picks the top of the range, so delays are exact."""

    def uniform(self, low, high):
        return high


def published(channel, event_type, data, pub_id="7"):
    """Return a pub/sub message as django-eventstream's send_event publishes it."""
    body = {"channel": channel, "event_type": event_type, "data": json.dumps(data), "pub_id": pub_id}
    return {"type": "message", "channel": b"events_channel", "data": json.dumps(body).encode()}


class FakeManager:
    def __init__(self):
        self.queued = []
        self.resyncs = []

    def relay_to_queues(self, channel, event):
        self.queued.append((channel, event.type, json.loads(event.data), event.id))

    async def resync(self, *, recheck_tokens):
        self.resyncs.append(recheck_tokens)


class Script:
    """A scripted Redis: each subscription plays one step (an error to raise, or messages then an error).

    The last step delivers its messages and then stays subscribed until the test cancels the listener.
    """

    def __init__(self, *steps):
        self.steps = list(steps)
        self.subscriptions = 0
        self.settled = asyncio.Event()

    @contextlib.asynccontextmanager
    async def subscribe(self):
        step = self.steps.pop(0)
        self.subscriptions += 1
        if isinstance(step, Exception):
            raise step
        messages, error = step
        last = not self.steps

        async def play():
            for message in messages:
                yield message
            if last:
                self.settled.set()
                await asyncio.Event().wait()  # connected and idle until cancelled
            raise error

        yield play()


def run_listener(script, manager, backoff=None):
    """Run a RedisEventListener over ``script`` until its last step; return (listener, sleeps)."""
    sleeps = []

    async def sleep(delay):
        sleeps.append(delay)

    listener = RedisEventListener(
        manager, subscribe=script.subscribe, sleep=sleep, backoff=backoff or Backoff(base=0.5, cap=10, rng=Upper())
    )

    async def main():
        task = asyncio.create_task(listener.run())
        await asyncio.wait_for(script.settled.wait(), timeout=5)
        assert listener.subscribed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return listener, sleeps


def refused():
    return ConnectionError("Error 111 connecting to 127.0.0.1:6390. Connection refused.")


def test_listener_resubscribes_after_losing_redis_and_relays_again(caplog):
    caplog.set_level(logging.INFO, logger="realtime.redis")
    manager = FakeManager()
    script = Script(
        (
            [published("worker-w_1", "job_submit", {"job_id": "j1"}, "1")],
            ConnectionError("Connection closed by server."),
        ),
        refused(),
        refused(),
        ([published("worker-w_1", "job_submit", {"job_id": "j2"}, "2")], None),
    )

    listener, sleeps = run_listener(script, manager)

    assert [(channel, data["job_id"], pub_id) for channel, _, data, pub_id in manager.queued] == [
        ("worker-w_1", "j1", "1"),
        ("worker-w_1", "j2", "2"),
    ]
    assert script.subscriptions == 4
    assert sleeps == [0.5, 1.0, 2.0]
    # Streams catch up after every subscription; tokens are re-checked only after a loss.
    assert manager.resyncs == [False, True]
    messages = [r.getMessage() for r in caplog.records if r.name == "realtime.redis"]
    assert messages == [
        "Redis event listener lost: Connection closed by server.; reconnecting in 0.5 s",
        "Redis event listener lost: Error 111 connecting to 127.0.0.1:6390. Connection refused.; reconnecting in 1.0 s",
        "Redis event listener lost: Error 111 connecting to 127.0.0.1:6390. Connection refused.; reconnecting in 2.0 s",
        "Redis event listener reconnected",
    ]


def test_backoff_is_capped_and_starts_over_after_a_subscription():
    manager = FakeManager()
    script = Script(*[refused() for _ in range(7)], ([], ConnectionError("gone")), refused(), ([], None))

    _, sleeps = run_listener(script, manager)

    assert sleeps == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 0.5, 1.0]


def test_a_subscription_that_just_ends_counts_as_lost():
    manager = FakeManager()

    @contextlib.asynccontextmanager
    async def ended():
        async def nothing():
            return
            yield

        yield nothing()

    script = Script(([], None))
    calls = []

    @contextlib.asynccontextmanager
    async def subscribe():
        calls.append(1)
        cm = ended() if len(calls) == 1 else script.subscribe()
        async with cm as messages:
            yield messages

    listener, sleeps = None, []

    async def sleep(delay):
        sleeps.append(delay)

    async def main():
        nonlocal listener
        listener = RedisEventListener(manager, subscribe=subscribe, sleep=sleep, backoff=Backoff(rng=Upper()))
        task = asyncio.create_task(listener.run())
        await asyncio.wait_for(script.settled.wait(), timeout=5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(calls) == 2 and sleeps == [1.0]


def test_malformed_and_non_message_traffic_is_ignored_without_dropping_the_subscription(caplog):
    manager = FakeManager()
    script = Script(
        (
            [
                {"type": "subscribe", "channel": b"events_channel", "data": 1},
                {"type": "message", "channel": b"events_channel", "data": b"not json"},
                {"type": "message", "channel": b"events_channel", "data": b'{"channel": "worker-w_1"}'},
                published("worker-w_1", "drain", {"type": "drain"}, None),
            ],
            None,
        )
    )

    _, sleeps = run_listener(script, manager)

    assert manager.queued == [("worker-w_1", "drain", {"type": "drain"}, None)]
    assert sleeps == []
    assert sum("ignored a malformed message" in r.getMessage() for r in caplog.records) == 2


# --- the listener manager ------------------------------------------------------------------------


def local_manager():
    """A listener manager without a Redis listener (whatever REDIS_URL says): these tests feed it directly."""
    manager = WorkerListenerManager()
    manager.redis_listener = None
    return manager


class Loop:
    """Stands in for a stream's event loop: records wake-ups instead of scheduling them."""

    def __init__(self):
        self.woken = 0

    def call_soon_threadsafe(self, callback):
        self.woken += 1


def local_stream(manager, token_id, worker_id):
    listener = Listener()
    listener.loop = Loop()
    listener.principal = StreamPrincipal(token_id, worker_id)
    listener.user_id = listener.principal.pk
    listener.channels = {worker_channel(worker_id)}
    manager.add_listener(listener)
    return listener


def test_catch_up_wakes_every_stream_to_re_read_storage():
    manager = local_manager()
    streams = [local_stream(manager, n, f"w_{n}") for n in range(3)]

    assert manager.catch_up_all() == 3

    assert [(s.overflow, s.loop.woken, s.principal.revoked) for s in streams] == [(True, 1, False)] * 3


# --- this process's own streams first, then Redis -------------------------------------------------


def queued_ids(listener, channel):
    return [int(event.id) for event in listener.channel_items.get(channel, ())]


def stored(channel, eid):
    return Event(channel, protocol.JOB_SUBMIT, json.dumps({"job_id": f"j{eid}"}), id=eid)


def relayed(channel, eid):
    """The event as the Redis listener rebuilds it from a pub/sub message (its id a string)."""
    return Event(channel, protocol.JOB_SUBMIT, json.dumps({"job_id": f"j{eid}"}), id=str(eid))


def test_an_event_next_after_the_last_queued_is_queued_at_once_and_its_echo_from_redis_dropped():
    manager = local_manager()
    stream_ = local_stream(manager, 1, "w_1")
    channel = worker_channel("w_1")
    manager.relay_to_queues(channel, relayed(channel, 4))

    assert manager.deliver_first(channel, stored(channel, 5)) is True
    assert queued_ids(stream_, channel) == [4, 5]
    manager.relay_to_queues(channel, relayed(channel, 5))  # Redis brings it back: dropped
    manager.relay_to_queues(channel, relayed(channel, 6))  # another process's next event: queued
    assert queued_ids(stream_, channel) == [4, 5, 6]
    assert stream_.loop.woken == 3


def test_an_event_after_a_gap_or_with_none_seen_since_the_stream_opened_waits_for_redis_in_its_order():
    manager = local_manager()
    stream_ = local_stream(manager, 1, "w_1")
    channel = worker_channel("w_1")

    assert manager.deliver_first(channel, stored(channel, 1)) is False  # nothing seen yet on this stream
    manager.relay_to_queues(channel, relayed(channel, 1))
    # Event 2 (another process's) is still on its way through Redis when event 3 commits here.
    assert manager.deliver_first(channel, stored(channel, 3)) is False
    manager.relay_to_queues(channel, relayed(channel, 2))
    manager.relay_to_queues(channel, relayed(channel, 3))

    assert queued_ids(stream_, channel) == [1, 2, 3]


def test_a_channel_left_by_its_last_stream_is_forgotten():
    manager = local_manager()
    first = local_stream(manager, 1, "w_1")
    channel = worker_channel("w_1")
    manager.relay_to_queues(channel, relayed(channel, 4))
    manager.remove_listener(first)
    again = local_stream(manager, 2, "w_1")

    assert manager.deliver_first(channel, stored(channel, 5)) is False  # 5 may not follow what this stream read
    assert queued_ids(again, channel) == []


def test_nothing_is_queued_first_on_a_channel_this_process_holds_no_stream_of():
    manager = local_manager()
    local_stream(manager, 1, "w_1")
    other = worker_channel("w_2")

    assert manager.deliver_first(other, stored(other, 1)) is False
    assert other not in manager.listeners_by_channel


def test_echoes_never_brought_back_are_forgotten_past_the_bound(monkeypatch):
    monkeypatch.setattr(listeners, "ECHOES_MAX", 2)
    manager = local_manager()
    stream_ = local_stream(manager, 1, "w_1")
    channel = worker_channel("w_1")
    manager.relay_to_queues(channel, relayed(channel, 1))
    for eid in (2, 3, 4):  # Redis is down: no echo comes back
        assert manager.deliver_first(channel, stored(channel, eid))

    assert list(manager._echoes) == [(channel, 3), (channel, 4)]
    manager.relay_to_queues(channel, relayed(channel, 2))  # a very late echo past the bound: queued again
    assert queued_ids(stream_, channel) == [1, 2, 3, 4, 2]


@pytest.fixture
def publishing(monkeypatch):
    """This process's manager holding worker w_1's stream, which has seen event 6, and a Redis that records
    what is published: ``(stream, channel, published messages)``."""
    manager = local_manager()
    monkeypatch.setattr(es_views, "listener_manager", manager)
    stream_ = local_stream(manager, 1, "w_1")
    channel = worker_channel("w_1")
    manager.relay_to_queues(channel, relayed(channel, 6))
    published = []

    class Redis:
        def publish(self, name, message):
            published.append({**json.loads(message), "queued_here": queued_ids(stream_, channel)})

    monkeypatch.setattr(es_eventstream, "redis_client", Redis())
    return stream_, channel, published


def test_an_event_that_fails_to_queue_first_is_left_to_redis(publishing, caplog):
    stream_, channel, published = publishing

    def closed_loop(callback):
        raise RuntimeError("Event loop is closed")

    stream_.loop.call_soon_threadsafe = closed_loop
    with caplog.at_level(logging.ERROR, logger="realtime.publish"):
        publish.publish_worker_event(stored(channel, 7))

    assert [m["pub_id"] for m in published] == ["7"]
    assert es_views.listener_manager._echoes == {}  # so Redis's relay of it is queued
    assert "goes through Redis" in caplog.text


@pytest.mark.django_db
def test_a_worker_event_reaches_this_processs_stream_before_redis_and_is_published_once(publishing):
    stream_, channel, published = publishing

    publish.publish_worker_event(stored(channel, 7))

    # queued here before it was published
    assert [(m["channel"], m["pub_id"], m["queued_here"]) for m in published] == [(channel, "7", [6, 7])]
    es_views.listener_manager.relay_to_queues(channel, relayed(channel, 7))
    assert queued_ids(stream_, channel) == [6, 7]


@pytest.mark.django_db
def test_streams_of_tokens_revoked_while_redis_was_down_are_closed():
    kept_worker, rotated_worker, deleted_worker = WorkerFactory(), WorkerFactory(), WorkerFactory()
    kept = token_issue(kind=TokenKind.WORKER, worker=kept_worker)[0]
    rotated = token_issue(kind=TokenKind.WORKER, worker=rotated_worker)[0]
    deleted = token_issue(kind=TokenKind.WORKER, worker=deleted_worker)[0]
    manager = local_manager()
    kept_stream = local_stream(manager, kept.pk, kept_worker.pk)
    rotated_stream = local_stream(manager, rotated.pk, rotated_worker.pk)
    deleted_stream = local_stream(manager, deleted.pk, deleted_worker.pk)
    Token.objects.filter(pk=rotated.pk).update(revoked_at="2030-01-01T00:00:00Z")
    deleted_worker.delete()

    assert manager.close_revoked_streams() == 2

    assert (kept_stream.principal.revoked, kept_stream.overflow) == (False, False)
    for closed, reason, code in ((rotated_stream, "token revoked", "token_revoked"), (deleted_stream, "worker deleted", "worker_deleted")):
        assert (closed.principal.revoked, closed.principal.revoked_reason, closed.principal.revoked_code, closed.loop.woken) == (
            True,
            reason,
            code,
            1,
        )


def test_the_manager_runs_one_redis_listener_task_per_loop_and_never_the_librarys():
    manager = WorkerListenerManager()
    started = []

    class Recording:
        async def run(self):
            started.append(asyncio.get_running_loop())
            await asyncio.Event().wait()

    manager.redis_listener = Recording()

    async def open_streams():
        for n in range(3):
            listener = Listener()
            listener.assign_loop()
            listener.channels = {f"worker-w_{n}"}
            manager.add_listener(listener)
        await asyncio.sleep(0)
        task = manager.redis_task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(open_streams())
    asyncio.run(open_streams())  # a new loop (the old task ended with its loop): a new task

    assert len(started) == 2 and started[0] is not started[1]
    assert manager.redis_listener_started  # the library's own start_redis_listener never runs


@pytest.mark.django_db(transaction=True)
def test_a_stream_that_missed_the_push_delivers_the_stored_event_after_catch_up(monkeypatch):
    """The library's own stream loop, fed by our manager: an event stored with no push arrives on catch-up."""
    manager = local_manager()
    monkeypatch.setattr(es_views, "listener_manager", manager)
    worker = WorkerFactory()
    token = token_issue(kind=TokenKind.WORKER, worker=worker)[0]
    channel = worker_channel(worker.pk)
    storage = DjangoModelStorage()
    principal = StreamPrincipal(token.pk, worker.pk)
    request = SimpleNamespace(
        channels={channel},
        channel_last_ids={channel: str(storage.get_current_id(channel))},
        is_next=False,
        is_recover=False,
        user=principal,
    )

    async def main():
        listener = Listener()
        listener.user_id = principal.pk
        listener.channels = {channel}
        listener.principal = principal
        chunks = stream(request, listener)
        assert "stream-open" in await asyncio.wait_for(anext(chunks), 5)
        waiting = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0.05)
        # Stored while Redis was down: the publish failed, so no process pushed it.
        await in_db_thread(storage.append_event)(channel, "job_submit", json.dumps({"job_id": "j1"}))
        await asyncio.sleep(0.05)
        assert not waiting.done()

        manager.catch_up_all()
        body = await asyncio.wait_for(waiting, 5)
        await chunks.aclose()
        await sync_to_async(close_connection)()  # the stream read storage on the shared sync thread
        return body

    body = asyncio.run(main())
    assert "event: job_submit" in body and '"job_id": "j1"' in body


# --- publishing while Redis is down --------------------------------------------------------------


def close_connection():
    connection.close()


def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@override_settings(EVENTSTREAM_REDIS={"host": "127.0.0.1", "port": 6379, "db": 0})
def test_install_replaces_the_librarys_publish_client_with_a_bounded_one(monkeypatch):
    monkeypatch.setattr(es_eventstream, "redis_client", object())
    monkeypatch.setattr(listeners, "_publish_client", None)

    listeners.install_listener_manager()
    client = es_eventstream.redis_client
    listeners.install_listener_manager()

    assert es_eventstream.redis_client is client  # idempotent
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_connect_timeout"] == realtime_redis.REDIS_CONNECT_TIMEOUT_S
    assert kwargs["retry"].get_retries() == realtime_redis.REDIS_PUBLISH_RETRIES


@pytest.fixture
def redis_down(monkeypatch):
    """The library publishes through our bounded client to a port where nothing listens."""
    with override_settings(EVENTSTREAM_REDIS={"host": "127.0.0.1", "port": closed_port(), "db": 0}):
        monkeypatch.setattr(es_eventstream, "redis_client", realtime_redis.redis_publish_client())


@pytest.mark.django_db
def test_a_dispatch_made_while_redis_is_down_is_committed_and_stored_and_the_request_goes_on(
    redis_down, commit, caplog
):
    from audit.services import Actor
    from job_queue.services import job_submit

    from workers.tests.support import sent_events

    worker = WorkerFactory()
    started = time.monotonic()
    with commit():  # fails the test if the on_commit callback raised
        caplog.set_level(logging.WARNING)
        job, dispatched = job_submit(config_name="c", actor=Actor.system("test"))
    elapsed = time.monotonic() - started

    assert dispatched and job.worker_id == worker.pk
    assert [e["data"]["job_id"] for e in sent_events(worker.pk)] == [job.pk]
    warnings = [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "realtime.publish"]
    assert warnings == [f"job_submit on worker-{worker.pk} not pushed, Redis is unreachable"]
    assert elapsed < 2, f"a dispatch waited {elapsed:.1f}s on a Redis that is down"


@pytest.mark.django_db
def test_a_revocation_made_while_redis_is_down_is_logged_and_the_request_goes_on(redis_down, commit, caplog):
    with commit():
        caplog.set_level(logging.WARNING)
        events.revoke_streams_on_commit("w_1", [5], "token rotated")

    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "realtime.publish"] == [
        "revoke on _control:worker-w_1 not pushed, Redis is unreachable"
    ]


@pytest.mark.django_db
def test_a_database_failure_while_sending_is_still_an_error(monkeypatch, commit):
    def broken(*args, **kwargs):
        raise RuntimeError("storage is down")

    monkeypatch.setattr(publish, "send_event", broken)

    with pytest.raises(AssertionError, match="storage is down"), commit():
        events.publish_on_commit("w_1", protocol.DRAIN)
