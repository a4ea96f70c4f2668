"""The apps' one way out: what a service announces in a transaction reaches the layers above once it commits.

The apps (audit, workers, job_queue) sit below the realtime transport and the metrics and never import
them. A service calls ``emit_on_commit(topic, **payload)`` inside its transaction; ``realtime`` and
``observability`` subscribe to the topics they serve in their ``AppConfig.ready()``. Nothing leaves
before the commit, and nothing leaves from a transaction that rolls back. (Zulip's
``send_event_on_commit``, with the import turned the other way.)

Topics are named by the app that emits them, beside its services (``workers.events``, ``job_queue.events``,
``audit.events``).
"""

from collections import defaultdict

from django.db import transaction

_subscribers = defaultdict(list)


def subscribe(topic, handler):
    """Call ``handler(**payload)`` for every ``topic`` emitted from now on (idempotent per handler)."""
    if handler not in _subscribers[topic]:
        _subscribers[topic].append(handler)


def emit(topic, **payload):
    """Hand ``payload`` to every subscriber of ``topic`` now. For callers already past the commit.

    A subscriber that raises does not keep the others from running; the first error is raised once
    they all have (after a commit, Django logs it: the change itself stands).
    """
    failure = None
    for handler in list(_subscribers.get(topic, ())):
        try:
            handler(**payload)
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def emit_on_commit(topic, **payload):
    """Emit ``topic`` with ``payload`` once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: emit(topic, **payload), robust=True)
