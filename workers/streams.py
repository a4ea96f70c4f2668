"""Which SSE streams are open for a worker, across server processes (the registry behind ``Worker.stream_id``)."""

import os
import secrets
import socket
from datetime import timedelta

from django.utils import timezone

from .models import ServerPresence

# Most streams remembered per worker: a bound on what a crashed process can leave behind.
MAX_OPEN_STREAMS = 32

_process_id = None


def server_process_id():
    """Return this server process's id, ``<host>:<pid>:<random>`` (the ``ServerPresence`` key it writes)."""
    global _process_id
    pid = os.getpid()
    if _process_id is None or _process_id.split(":")[-2] != str(pid):
        _process_id = f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}"
    return _process_id


def live_server_processes(*, now=None, interval):
    """Return the ids of server processes that recorded their presence within 1.5 ``interval`` s, or None
    when no server records its presence at all (then nothing can be said about any stream's process)."""
    now = now or timezone.now()
    seen = list(ServerPresence.objects.values_list("pk", "last_seen"))
    if not seen:
        return None
    live_after = now - timedelta(seconds=1.5 * interval)
    return {pk for pk, last_seen in seen if last_seen >= live_after}


def streams_with(entries, *, stream_id, process, live):
    """Return ``entries`` plus the newly opened ``stream_id`` (newest last), less the streams of dead processes.

    ``live`` is the set of live server processes (None: unknown, keep all); this process always counts as
    live. At most ``MAX_OPEN_STREAMS`` are kept (the oldest go first).
    """
    kept = [
        entry
        for entry in _valid(entries)
        if live is None or entry.get("process") in live or entry.get("process") == process
    ]
    kept.append({"id": stream_id, "process": process})
    return kept[-MAX_OPEN_STREAMS:]


def streams_without(entries, stream_id):
    """Return ``entries`` less ``stream_id``."""
    return [entry for entry in _valid(entries) if entry["id"] != stream_id]


def newest_stream_id(entries):
    """Return the id of the newest stream in ``entries``, or None when none is open."""
    return entries[-1]["id"] if entries else None


def _valid(entries):
    return [entry for entry in entries or () if isinstance(entry, dict) and isinstance(entry.get("id"), str)]


def agent_key(entry):
    """Return the key of the agent holding the stream ``entry``: its instance (``protocol.AGENT_INSTANCE_HEADER``),
    else the stream's own id (an agent that says no instance is told apart by nothing but its stream)."""
    return f"i:{entry['instance']}" if entry.get("instance") else f"s:{entry['id']}"


def serving_entry(worker):
    """Return the entry of ``worker``'s current stream (``stream_id``): its agent serves the worker; or None."""
    if worker.stream_id is None:
        return None
    return next((entry for entry in _valid(worker.open_streams) if entry["id"] == worker.stream_id), None)


def other_agents_streams(entries, instance):
    """Split ``entries`` into ``(kept, replaced)``: kept are the earlier streams of agent ``instance`` (a reconnect,
    never another agent); replaced, every other (each agent without an instance is an agent of its own)."""
    kept, replaced = [], []
    for entry in _valid(entries):
        (kept if instance and entry.get("instance") == instance else replaced).append(entry)
    return kept, replaced
