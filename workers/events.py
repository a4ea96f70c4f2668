"""SSE channels and event types for workers; every publish leaves only after the transaction commits."""

import asyncio
import contextlib
import json
import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django_eventstream import eventstream as es_eventstream
from django_eventstream import send_event
from django_eventstream import views as es_views
from django_eventstream.channelmanager import ChannelManagerBase
from django_eventstream.event import Event
from redis.exceptions import RedisError

from audit.events import CHANGES_CHANNEL, OperatorPrincipal
from worker_agent.backoff import Backoff

logger = logging.getLogger(__name__)

# Event types, carried both as the SSE `event:` field and as `type` in the JSON data.
JOB_SUBMIT = "job_submit"
JOB_CANCEL = "job_cancel"
DRAIN = "drain"
SHUTDOWN = "shutdown"

# Control messages travel on unstored channels (through Redis when configured, so every process
# sees them) and are consumed by the listener manager; they never reach a client as an event.
CONTROL_PREFIX = "_control:"
REVOKE = "revoke"


def worker_channel(worker_id):
    """Return the SSE channel that carries ``worker_id``'s dispatch feed."""
    return f"worker-{worker_id}"


def stream_principal_id(token_id):
    """Return the listener identity of a stream opened with token ``token_id`` (used to close it)."""
    return f"token:{token_id}"


def _send(channel, event_type, data):
    """``send_event``; a Redis failure is logged, not raised: the event is stored and every stream catches up.

    The library stores the event before it publishes it, and each server's Redis event listener makes
    its streams re-read storage (and re-check their tokens) when it resubscribes after an outage.
    """
    try:
        send_event(channel, event_type, data)
    except RedisError as exc:
        logger.warning(
            "%s on %s not pushed, Redis is unreachable (%s): streams catch up when Redis is back",
            event_type,
            channel,
            _one_line(exc),
        )


def publish_on_commit(worker_id, event_type, **payload):
    """Send ``event_type`` with ``payload`` to ``worker_id``'s stream once the current transaction commits."""
    data = {"type": event_type, **payload}
    channel = worker_channel(worker_id)
    transaction.on_commit(lambda: _send(channel, event_type, data), robust=True)


def revoke_streams_on_commit(worker_id, token_ids, reason):
    """Close every open stream of ``worker_id`` that was opened with one of ``token_ids``, on commit."""
    data = {"tokens": [stream_principal_id(t) for t in token_ids], "reason": reason}
    channel = CONTROL_PREFIX + worker_channel(worker_id)
    transaction.on_commit(lambda: _send(channel, REVOKE, data), robust=True)


class StreamPrincipal:
    """Stands in for ``request.user`` on a worker stream: which token opened it and what it may read."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, token_id, worker_id):
        self.token_id = token_id
        self.pk = stream_principal_id(token_id)
        self.worker_id = worker_id
        self.channels = frozenset({worker_channel(worker_id)})
        self.revoked = False
        self.revoked_reason = ""


class WorkerChannelManager(ChannelManagerBase):
    """Streams read exactly the channels our view passes; ``?channel=`` from a client is never honoured.

    A worker stream reads its own channel; the operators' change feed (``audit.events``) is read by
    signed-in staff whom ``audit.live`` let in (it checks the session and the view permissions).
    """

    def get_channels_for_request(self, request, view_kwargs):
        return set(view_kwargs.get("channels", ()))

    def can_read_channel(self, user, channel):
        if isinstance(user, StreamPrincipal):
            return not user.revoked and channel in user.channels
        return channel == CHANGES_CHANNEL and isinstance(user, OperatorPrincipal)

    def is_channel_reliable(self, channel):
        return not channel.startswith(CONTROL_PREFIX) and channel != CHANGES_CHANNEL


# --- Redis: the library's pub/sub, made to survive an outage -------------------------------------

# The one pub/sub channel the library publishes every event on (django_eventstream.eventstream.send_event).
REDIS_EVENTS_CHANNEL = "events_channel"
# A connect attempt to an unreachable Redis gives up after this long (unless EVENTSTREAM_REDIS says otherwise).
REDIS_CONNECT_TIMEOUT_S = 2
# Publishing retries once (a stale pooled connection after a Redis restart), then gives up: the event is
# already stored, and a subscriber that reconnects makes every stream re-read storage.
REDIS_PUBLISH_RETRIES = 1
RESUBSCRIBE_BASE_S = 0.5
RESUBSCRIBE_CAP_S = 10.0
_TOKEN_CHUNK = 500
_publish_client = None  # ours, once installed in place of the library's


def redis_options(retry):
    """Return ``settings.EVENTSTREAM_REDIS`` as client kwargs, with ``retry`` and a short connect timeout."""
    return {"socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S, **settings.EVENTSTREAM_REDIS, "retry": retry}


def redis_publish_client():
    """Return a blocking Redis client for ``send_event`` that fails within seconds while Redis is down."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(**redis_options(Retry(NoBackoff(), REDIS_PUBLISH_RETRIES)))


@contextlib.asynccontextmanager
async def redis_subscription():
    """Subscribe to the library's channel on a fresh connection; yield its messages (connection errors escape).

    redis-py retries nothing here: every failure surfaces at once to ``RedisEventListener``, which owns
    the retry policy.
    """
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    client = Redis(**redis_options(Retry(NoBackoff(), 0)))
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(REDIS_EVENTS_CHANNEL)
        messages = pubsub.listen()
        try:
            yield messages
        finally:
            await messages.aclose()
    finally:
        for closing in (pubsub, client):
            try:
                await closing.aclose()
            except Exception as exc:  # noqa: BLE001 - a dead connection may fail to close; it is dropped anyway
                logger.debug("closing a Redis connection failed: %s", exc)


def _one_line(exc):
    return " ".join(str(exc).split()) or type(exc).__name__


class RedisEventListener:
    """Relays events published through Redis to this process's streams, resubscribing after any failure.

    Replaces the library's ``RedisListener``, whose task ends for good when redis-py's own reconnect
    attempts give up (a few seconds into a Redis outage): the process then never delivers another event
    to a stream it holds. After every (re)subscription all local streams re-read storage, so events
    published while this process was not subscribed still arrive.
    """

    def __init__(self, manager, *, subscribe=redis_subscription, sleep=asyncio.sleep, backoff=None):
        self.manager = manager
        self._subscribe = subscribe
        self._sleep = sleep
        self.backoff = backoff or Backoff(base=RESUBSCRIBE_BASE_S, cap=RESUBSCRIBE_CAP_S)
        self.subscribed = False

    async def run(self):
        """Subscribe and relay until cancelled; after a failure wait (backoff) and subscribe again."""
        lost = False
        while True:
            try:
                async with self._subscribe() as messages:
                    self.subscribed = True
                    self.backoff.reset()
                    if lost:
                        logger.info("Redis event listener reconnected")
                    await self.manager.resync(recheck_tokens=lost)
                    async for message in messages:
                        self.relay(message)
                raise ConnectionError("Redis ended the subscription")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever ended the subscription, subscribe again
                self.subscribed = False
                lost = True
                delay = self.backoff.next_delay()
                logger.warning("Redis event listener lost: %s; reconnecting in %.1f s", _one_line(exc), delay)
                await self._sleep(delay)

    async def start(self):
        """The library's entry point (``ListenerManager.start_redis_listener``)."""
        await self.run()

    def relay(self, message):
        """Hand one pub/sub message (as published by ``send_event``) to the local listeners."""
        if message.get("type") != "message":
            return
        try:
            published = json.loads(message["data"])
            channel = published["channel"]
            event = Event(channel, published["event_type"], published["data"], id=published["pub_id"])
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignored a malformed message on Redis channel %s: %s", REDIS_EVENTS_CHANNEL, exc)
            return
        self.manager.add_to_queues(channel, event)


def in_db_thread(fn):
    """Run ``fn`` in a pool thread (not the stream's shared sync thread) and close its DB connection after."""

    def wrapper(*args, **kwargs):
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            connection.close()

    return sync_to_async(wrapper, thread_sensitive=False)


class WorkerListenerManager(es_views.ListenerManager):
    """The library's listener registry, plus control messages that end streams across processes,
    and a Redis subscriber that survives a Redis outage."""

    def __init__(self):
        super().__init__()
        # The library built its own RedisListener (nothing connected yet); ours replaces it.
        self.redis_listener = RedisEventListener(self) if self.redis_listener is not None else None
        self.redis_task = None

    def add_listener(self, listener):
        if self.redis_listener is not None:
            self._ensure_redis_listener()
        super().add_listener(listener)

    def _ensure_redis_listener(self):
        """Start the Redis listener task on the running loop unless it already runs there."""
        loop = asyncio.get_running_loop()
        with self.lock:
            task = self.redis_task
            if task is None or task.done() or task.get_loop() is not loop:
                self.redis_task = loop.create_task(self.redis_listener.run(), name="redis-event-listener")
            self.redis_listener_started = True  # keeps the library from starting one of its own

    def listeners(self):
        """Return every local listener (a snapshot)."""
        with self.lock:
            return {listener for listeners in self.listeners_by_channel.values() for listener in listeners}

    def add_to_queues(self, channel, event):
        if channel.startswith(CONTROL_PREFIX):
            if event.type == REVOKE:
                data = json.loads(event.data) if isinstance(event.data, str) else event.data
                self.revoke(channel[len(CONTROL_PREFIX):], set(data.get("tokens", ())), data.get("reason", ""))
            return
        super().add_to_queues(channel, event)

    def revoke(self, channel, principals, reason):
        """End the local streams on ``channel`` held by any of ``principals``.

        The principal is marked revoked and the stream woken as if its queue overflowed: the library
        then re-reads the channel, finds it no longer readable, sends ``stream-error`` and ends.
        """
        with self.lock:
            doomed = [
                listener
                for listener in self.listeners_by_channel.get(channel, ())
                if listener.user_id in principals
            ]
            for listener in doomed:
                listener.principal.revoked = True
                listener.principal.revoked_reason = reason or "access revoked"
                listener.overflow = True
        for listener in doomed:
            listener.wake_threadsafe()
        if doomed:
            logger.info("closed %d stream(s) on %s: %s", len(doomed), channel, reason)

    def catch_up_all(self):
        """Make every local stream re-read its channels from storage (it may have missed a push); return how many."""
        listeners = self.listeners()
        with self.lock:
            for listener in listeners:
                listener.overflow = True
        for listener in listeners:
            listener.wake_threadsafe()
        return len(listeners)

    def close_revoked_streams(self):
        """Close local streams whose token was revoked or deleted; return how many tokens (sync: reads the DB).

        Revocations travel as control messages through Redis; one sent while Redis was down reached
        no other process.
        """
        from .models import Token

        held = {}  # token id -> channels
        for listener in self.listeners():
            principal = getattr(listener, "principal", None)
            if isinstance(principal, StreamPrincipal) and not principal.revoked:
                held.setdefault(principal.token_id, set()).update(principal.channels)
        token_ids = sorted(held)
        active = set()
        for start in range(0, len(token_ids), _TOKEN_CHUNK):
            chunk = token_ids[start : start + _TOKEN_CHUNK]
            active.update(Token.objects.filter(pk__in=chunk, revoked_at__isnull=True).values_list("pk", flat=True))
        closed = 0
        for token_id in held.keys() - active:
            for channel in held[token_id]:
                self.revoke(channel, {stream_principal_id(token_id)}, "token revoked")
            closed += 1
        return closed

    async def resync(self, *, recheck_tokens):
        """After a (re)subscription: close the streams of tokens revoked meanwhile (if asked), then catch up all."""
        if recheck_tokens:
            try:
                await in_db_thread(self.close_revoked_streams)()
            except Exception:
                logger.exception("could not re-check the tokens of open streams after a Redis outage")
        woken = self.catch_up_all()
        if recheck_tokens and woken:
            logger.info("%d stream(s) re-read storage after the Redis event listener reconnected", woken)


def install_listener_manager():
    """Replace the library's module-level listener manager with ours, and its Redis publish client (idempotent)."""
    if not isinstance(es_views.listener_manager, WorkerListenerManager):
        es_views.listener_manager = WorkerListenerManager()
    global _publish_client
    if es_eventstream.redis_client is not None and es_eventstream.redis_client is not _publish_client:
        _publish_client = es_eventstream.redis_client = redis_publish_client()
