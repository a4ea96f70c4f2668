"""Helpers shared by the worker management commands: the acting system user, worker look-up, errors."""

from contextlib import contextmanager

from django.core.management.base import CommandError
from django.db.models import Q

from audit.services import Actor
from common.errors import ServiceError
from common.humanize import printable
from workers.models import Worker


def command_actor(command):
    """Return the system actor that audit rows written by ``manage.py <command>`` name."""
    return Actor.system(f"manage.py {command}")


def one_line(message):
    """Return ``message`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(message).split())


@contextmanager
def service_errors():
    """Turn a ServiceError raised inside into a CommandError carrying its one-line message."""
    try:
        yield
    except ServiceError as exc:
        raise CommandError(one_line(exc.detail)) from None


def worker_lookup(value):
    """Return the worker whose id or name is ``value``.

    Raise CommandError if there is none, or if ``value`` is one worker's id and another's name.
    """
    value = (value or "").strip()
    matches = list(Worker.objects.filter(Q(pk=value) | Q(name=value))[:2]) if value else []
    if not matches:
        raise CommandError(f"no worker with id or name {value!r}")
    if len(matches) > 1:
        by_id, by_name = sorted(matches, key=lambda w: w.pk != value)
        raise CommandError(
            f"{value!r} is both the id of worker {by_id.name!r} and the name of worker {by_name.pk}; "
            f"pass {by_id.name!r} or {by_name.pk!r} instead"
        )
    return matches[0]


def describe(worker):
    """Return ``name (id)`` for messages."""
    return printable(f"{worker.name} ({worker.pk})")
