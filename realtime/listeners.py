"""Who may read which stream, and the per-process registry of open streams (revocation, catch-up)."""

import asyncio
import json
import logging
import threading
from collections import OrderedDict

from django_eventstream import eventstream as es_eventstream
from django_eventstream import views as es_views
from django_eventstream.channelmanager import ChannelManagerBase

from worker_agent import protocol
from workers.models import Token

from . import operator_feed
from .db import in_db_thread
from .operator_feed import CHANGES_CHANNEL, OperatorPrincipal
from .publish import CONTROL_PREFIX, REVOKE, stream_principal_id, worker_channel
from .redis import RedisEventListener, redis_publish_client

logger = logging.getLogger(__name__)

_TOKEN_CHUNK = 500
# Events queued here before Redis brought them back, whose echo is still due (a bound: an echo Redis never
# brings back, while it is down, is forgotten after this many more).
ECHOES_MAX = 10_000
_publish_client = None  # ours, once installed in place of the library's


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
        self.revoked_code = ""


class Wakeup:
    """What the library's stream loop uses of ``asyncio.Event`` (``wait``, ``set``, ``clear``, ``is_set``), without
    its 760-byte deque of waiters: a stream has one waiter at a time, so an idle stream keeps ~100 bytes here.
    Like asyncio.Event, used on its event loop only (other threads wake it with ``call_soon_threadsafe``)."""

    __slots__ = ("_set", "_waiters")

    def __init__(self):
        self._set = False
        self._waiters = ()

    def is_set(self):
        return self._set

    def set(self):
        if not self._set:
            self._set = True
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(True)

    def clear(self):
        self._set = False

    async def wait(self):
        if self._set:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters = (*self._waiters, waiter)
        try:
            await waiter
            return True
        finally:
            self._waiters = tuple(other for other in self._waiters if other is not waiter)


class StreamListener(es_views.Listener):
    """The library's listener for a worker stream held by ``principal``, woken by a ``Wakeup``."""

    def __init__(self, principal, channels):
        super().__init__()
        self.aevent = Wakeup()
        self.user_id = principal.pk
        self.channels = channels
        self.principal = principal


class WorkerChannelManager(ChannelManagerBase):
    """Streams read exactly the channels our view passes; ``?channel=`` from a client is never honoured.

    A worker stream reads its own channel; the operators' change feed (``audit.events``) is read by
    signed-in staff whom ``realtime.operator_feed`` let in (it checks the session and the view permissions).
    """

    def get_channels_for_request(self, request, view_kwargs):
        return set(view_kwargs.get("channels", ()))

    def can_read_channel(self, user, channel):
        if isinstance(user, StreamPrincipal):
            return not user.revoked and channel in user.channels
        return channel == CHANGES_CHANNEL and isinstance(user, OperatorPrincipal) and not user.revoked

    def is_channel_reliable(self, channel):
        return not channel.startswith(CONTROL_PREFIX) and channel != CHANGES_CHANNEL


class WorkerListenerManager(es_views.ListenerManager):
    """The library's listener registry, plus control messages that end streams across processes,
    and a Redis subscriber that survives a Redis outage."""

    def __init__(self):
        super().__init__()
        # Re-entrant: ``deliver_first`` queues an event under the lock that decided it may.
        self.lock = threading.RLock()
        # The library built its own RedisListener (nothing connected yet); ours replaces it.
        self.redis_listener = RedisEventListener(self) if self.redis_listener is not None else None
        self.redis_task = None
        self._last_id = {}  # channel with a local listener -> id of the newest stored event queued on it
        self._echoes = OrderedDict()  # (channel, id) of events queued by deliver_first, until Redis echoes them

    def remove_listener(self, listener):
        with self.lock:
            super().remove_listener(listener)
            for channel in listener.channels:
                if channel not in self.listeners_by_channel:
                    self._last_id.pop(channel, None)

    def deliver_first(self, channel, event):
        """Queue stored ``event``, just committed in this process, to this process's streams on ``channel`` now,
        ahead of its trip through Redis; return whether it did (then its echo from Redis is dropped).

        Only an event that directly follows the last one queued on the channel: a channel's ids are
        given and committed in order, so then none published by another process can still be on its
        way to land before it. Otherwise (a gap, or no event seen since the stream opened) it waits
        for Redis, as every event did before, and arrives in the order Redis relays it.
        """
        if event.id is None:
            return False
        with self.lock:  # the Redis listener's relay waits: the echo is recorded before it can arrive
            last = self._last_id.get(channel)
            if last is None or int(event.id) != last + 1:
                return False
            self.add_to_queues(channel, event)
            self._echoes[(channel, int(event.id))] = None  # only once queued: a failure leaves it to Redis
            if len(self._echoes) > ECHOES_MAX:
                self._echoes.popitem(last=False)
        return True

    def relay_to_queues(self, channel, event):
        """Queue ``event`` relayed by Redis, unless it is the echo of one ``deliver_first`` queued already."""
        with self.lock:
            echo = None if event.id is None else (channel, int(event.id))
            if echo in self._echoes:
                del self._echoes[echo]
                return
            self.add_to_queues(channel, event)

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
            data = json.loads(event.data) if isinstance(event.data, str) else event.data
            if event.type == operator_feed.RECHECK:
                operator_feed.recheck_soon(data.get("users", ()))
            elif event.type == REVOKE:
                self.revoke(
                    channel[len(CONTROL_PREFIX):],
                    set(data.get("tokens", ())),
                    data.get("reason", ""),
                    code=data.get("code", protocol.TOKEN_REVOKED),
                )
            return
        with self.lock:
            if event.id is not None and channel in self.listeners_by_channel:
                self._last_id[channel] = int(event.id)
            super().add_to_queues(channel, event)

    def revoke(self, channel, principals, reason, *, code=protocol.TOKEN_REVOKED):
        """End the local streams on ``channel`` held by any of ``principals``, telling them ``reason`` and ``code``.

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
                listener.principal.revoked_code = code
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
        held = {}  # token id -> channels
        for listener in self.listeners():
            principal = getattr(listener, "principal", None)
            if isinstance(principal, StreamPrincipal) and not principal.revoked:
                held.setdefault(principal.token_id, set()).update(principal.channels)
        token_ids = sorted(held)
        revoked_at = {}  # token id -> when it was revoked (None: still active); absent: deleted with its worker
        for start in range(0, len(token_ids), _TOKEN_CHUNK):
            chunk = token_ids[start : start + _TOKEN_CHUNK]
            revoked_at.update(Token.objects.filter(pk__in=chunk).values_list("pk", "revoked_at"))
        closed = 0
        for token_id in held:
            if token_id in revoked_at and revoked_at[token_id] is None:
                continue
            reason, code = (
                ("token revoked", protocol.TOKEN_REVOKED) if token_id in revoked_at else ("worker deleted", protocol.WORKER_DELETED)
            )
            for channel in held[token_id]:
                self.revoke(channel, {stream_principal_id(token_id)}, reason, code=code)
            closed += 1
        return closed

    async def resync(self, *, recheck_tokens):
        """After a (re)subscription: close the streams of tokens revoked meanwhile and the operator feeds no longer
        allowed (if asked), then catch up all."""
        if recheck_tokens:
            try:
                await in_db_thread(self.close_revoked_streams)()
            except Exception:
                logger.exception("could not re-check the tokens of open streams after a Redis outage")
            try:
                await in_db_thread(operator_feed.close_unfollowable_feeds)()
            except Exception:
                logger.exception("could not re-check the operator feeds after a Redis outage")
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
