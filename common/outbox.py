"""The apps' one way out: what a service announces in a transaction reaches the layers above once it commits.

The apps (audit, workers, job_queue) sit below the realtime transport and the metrics and never import
them. A service calls ``emit_on_commit(topic, **payload)`` inside its transaction; ``realtime`` and
``observability`` subscribe to the topics they serve in their ``AppConfig.ready()``. Nothing leaves
before the commit, and nothing leaves from a transaction that rolls back. (Zulip's
``send_event_on_commit``, with the import turned the other way.)

A subscriber that must also write something durable (``realtime`` stores every worker event before it
pushes it) subscribes in two steps (``subscribe_staged``): its ``stage`` writes in the emitting
transaction itself when that transaction stages its outbox before committing (``stage_pending``, which
``audit.services.audited_atomic`` calls last thing before the audit chain's lock), so the change and
what it announces commit together; only its ``publish`` waits for the commit. Emitted from a transaction
that does not stage, both steps run after the commit, ``stage`` in a transaction of its own.

Topics are named by the app that emits them, beside its services (``workers.events``, ``job_queue.events``,
``audit.events``).
"""

from collections import defaultdict
from dataclasses import dataclass

from django.db import connection, transaction

_subscribers = defaultdict(list)
_staged_subscribers = defaultdict(list)


@dataclass(frozen=True)
class StagedSubscriber:
    stage: object  # stage(**payload) -> value, run in a transaction (the emitter's, or its own)
    publish: object  # publish(value), run after that transaction commits
    order: object  # order(**payload) -> sort key: what several staged emits lock, they lock in this order


def subscribe(topic, handler):
    """Call ``handler(**payload)`` for every ``topic`` emitted from now on (idempotent per handler)."""
    if handler not in _subscribers[topic]:
        _subscribers[topic].append(handler)


def subscribe_staged(topic, *, stage, publish, order):
    """Serve ``topic`` in two steps (see the module's docstring; idempotent per ``stage``).

    ``stage`` takes the rows it writes in ``order``'s key order (then in emit order), after every other
    lock the transaction takes except the audit chain's head, so two transactions cannot take them in
    opposite orders.
    """
    if all(existing.stage is not stage for existing in _staged_subscribers[topic]):
        _staged_subscribers[topic].append(StagedSubscriber(stage, publish, order))


def emit(topic, **payload):
    """Hand ``payload`` to every subscriber of ``topic`` now. For callers already past the commit.

    A subscriber that raises does not keep the others from running; the first error is raised once
    they all have (after a commit, Django logs it: the change itself stands).
    """
    _deliver(topic, payload, staged={})


def _deliver(topic, payload, staged):
    """Run ``topic``'s subscribers; a staged one publishes ``staged[its index]`` (staged in the emitter's
    transaction), else stages in a transaction of its own first."""
    failure = None
    for handler in list(_subscribers.get(topic, ())):
        try:
            handler(**payload)
        except Exception as exc:
            failure = failure or exc
    for i, subscriber in enumerate(list(_staged_subscribers.get(topic, ()))):
        try:
            if i in staged:
                value = staged[i]
            else:
                with transaction.atomic():
                    value = subscriber.stage(**payload)
            subscriber.publish(value)
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


class _Emitted:
    """The commit callback of one ``emit_on_commit``: delivers the topic, with what was staged before the commit."""

    def __init__(self, topic, payload):
        self.topic = topic
        self.payload = payload
        self.staged = None  # {staged subscriber index: value} once stage_pending ran it in the transaction
        self.__qualname__ = f"outbox.emit({topic!r})"  # Django names a failed commit callback by it

    def __call__(self):
        _deliver(self.topic, self.payload, self.staged or {})


def emit_on_commit(topic, **payload):
    """Emit ``topic`` with ``payload`` once the current transaction commits (at once outside one)."""
    transaction.on_commit(_Emitted(topic, payload), robust=True)


def pending_on_commit():
    """Return the current transaction's commit callbacks still due: those of a savepoint that rolled back are gone."""
    return [func for _savepoints, func, _robust in connection.run_on_commit] if connection.in_atomic_block else []


def stage_pending():
    """Run, in the current transaction, the ``stage`` of every staged subscriber of what it has emitted so far.

    Call it last thing before the transaction's final lock (``audited_atomic`` does); what is emitted after
    it is staged after the commit, as if it had not been called. Each emit is staged once.
    """
    work = []
    for emitted in pending_on_commit():
        if isinstance(emitted, _Emitted) and emitted.staged is None and _staged_subscribers.get(emitted.topic):
            emitted.staged = {}
            for i, subscriber in enumerate(_staged_subscribers[emitted.topic]):
                work.append((subscriber.order(**emitted.payload), len(work), emitted, i, subscriber))
    for _key, _n, emitted, i, subscriber in sorted(work, key=lambda item: (item[0], item[1])):
        emitted.staged[i] = subscriber.stage(**emitted.payload)
