"""One agent serves a worker: the agent a request names, and telling the agents another one took the worker over from.

The rule (``docs/reliability.md``): the newest agent serves. Registration and stream opening
(``job_queue.agents``) decide which stream entries are replaced; this module records them and tells them.
"""

import re

from audit import actions
from audit.services import audit_record
from common.errors import InvalidInput
from worker_agent import protocol
from workers import events as worker_events
from workers.models import Worker

from .dispatch import REPLACED_STREAMS

_INSTANCE = re.compile(r"[A-Za-z0-9_-]+")
REPLACED_KEPT = 16  # instances remembered per worker as taken over from (Worker.replaced_instances)


def agent_instance(value):
    """Return the agent instance a request names (``protocol.AGENT_INSTANCE_HEADER``), or None when it names none;
    raise InvalidInput (400) for one that is not 1-64 letters, digits, "-" or "_"."""
    if not value:
        return None
    if len(value) > protocol.AGENT_INSTANCE_MAX_CHARS or not _INSTANCE.fullmatch(value):
        raise InvalidInput(
            f"{protocol.AGENT_INSTANCE_HEADER} must be 1-{protocol.AGENT_INSTANCE_MAX_CHARS} letters, digits, '-' or '_'",
            code="invalid_agent_instance",
        )
    return value


def remember_replaced(worker, instances):
    """Record ``instances`` as agents another agent took the locked ``worker`` over from (their registrations are
    refused from now on), keeping the newest REPLACED_KEPT."""
    if instances:
        kept = [i for i in worker.replaced_instances or () if i not in instances]
        worker.replaced_instances = [*kept, *dict.fromkeys(instances)][-REPLACED_KEPT:]
        Worker.objects.filter(pk=worker.pk).update(replaced_instances=worker.replaced_instances)


def replace_agents(*, worker, replaced, name, host, actor):
    """Tell the agents holding the ``replaced`` stream entries of the locked ``worker`` that the agent ``name`` on
    ``host`` took the worker over: a ``shutdown`` (``protocol.AGENT_REPLACED``) on the worker's channel that only
    those streams deliver, and end with (``REPLACED_STREAMS``, ``realtime.streams``); audited."""
    if not replaced:
        return
    remember_replaced(worker, [entry["instance"] for entry in replaced if entry.get("instance")])
    who = f"{name or 'an agent'} on {host or 'an unknown host'}"
    worker_events.publish_on_commit(
        worker.pk,
        protocol.SHUTDOWN,
        reason=f"another agent took this worker over with its token: {who}; this agent gets no more jobs",
        code=protocol.AGENT_REPLACED,
        agent_name=name,
        agent_host=host,
        **{REPLACED_STREAMS: [entry["id"] for entry in replaced]},
    )
    audit_record(
        actor=actor,
        action=actions.WORKER_AGENT_REPLACED,
        target_type="worker",
        target_id=worker.pk,
        details={
            "by": {"name": name, "host": host},
            "replaced": [{k: entry.get(k) for k in ("name", "host", "instance")} for entry in replaced],
        },
    )
