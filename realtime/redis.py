"""Redis pub/sub for django-eventstream, made to survive an outage: the publish client and the subscriber."""

import asyncio
import contextlib
import json
import logging

from django.conf import settings
from django_eventstream.event import Event

from worker_agent.backoff import Backoff

from .publish import one_line

logger = logging.getLogger(__name__)

# The one pub/sub channel the library publishes every event on (django_eventstream.eventstream.send_event).
REDIS_EVENTS_CHANNEL = "events_channel"
# A connect attempt to an unreachable Redis gives up after this long (unless EVENTSTREAM_REDIS says otherwise).
REDIS_CONNECT_TIMEOUT_S = 2
# Publishing retries once (a stale pooled connection after a Redis restart), then gives up: the event is
# already stored, and a subscriber that reconnects makes every stream re-read storage.
REDIS_PUBLISH_RETRIES = 1
RESUBSCRIBE_BASE_S = 0.5
RESUBSCRIBE_CAP_S = 10.0


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
                logger.warning("Redis event listener lost: %s; reconnecting in %.1f s", one_line(exc), delay)
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
        self.manager.relay_to_queues(channel, event)


