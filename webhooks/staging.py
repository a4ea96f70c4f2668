"""Deliveries staged in the transaction that changes a job's or a worker's status (``common.outbox.subscribe_staged``).

A job that completes, fails, is cancelled or goes back to the queue, and a worker that goes offline, get one
delivery per active webhook that subscribes to the event: written with the change (so a rolled-back change
delivers nothing, and a committed one is delivered even if the process dies right after the commit), sent
after the commit (``webhooks.sender``). A sweep's set of changes is written with one query per step, whatever
its size. ``data`` is the job or worker as the API shows it, read in that transaction.
"""

import json
from datetime import timedelta

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder

from job_queue.api.serializers import JobSerializer
from job_queue.models import Job, JobStatus
from workers.api.serializers import WorkerSerializer
from workers.models import Worker, WorkerStatus

from . import models
from .models import Delivery, WebhookFormat
from .selectors import webhooks_subscribed

RETRY_WINDOW = timedelta(hours=24)  # a delivery is retried at least this long after its event
ROWS_PER_INSERT = 500

JOB_EVENTS = {
    JobStatus.COMPLETED: models.JOB_COMPLETED,
    JobStatus.FAILED: models.JOB_FAILED,
    JobStatus.CANCELLED: models.JOB_CANCELLED,
    JobStatus.QUEUED: models.JOB_REQUEUED,  # a job enters the queue again only from an attempt (dispatched, running)
}
WORKER_EVENTS = {WorkerStatus.OFFLINE: models.WORKER_OFFLINE}


def order(**_payload):
    """Where the webhooks' stage comes among a transaction's staged writes: after the worker channels' (it locks
    nothing of theirs; the key only has to compare with theirs, which are strings)."""
    return "~webhooks"


def stage_jobs(*, changes, at):
    """Stage of ``job_queue.events.STATUS_CHANGED``: write the deliveries of ``changes``; return how many."""
    wanted = [(pk, JOB_EVENTS[to]) for pk, _from, to in changes if to in JOB_EVENTS]
    return _stage(wanted, at, kind="job", read=_jobs_shown)


def stage_workers(*, changes, at):
    """Stage of ``workers.events.STATUS_CHANGED``: write the deliveries of ``changes``; return how many."""
    wanted = [(pk, WORKER_EVENTS[to]) for pk, _from, to in changes if to in WORKER_EVENTS]
    return _stage(wanted, at, kind="worker", read=_workers_shown)


def published(count):
    """Publish of both topics: once the deliveries are committed, have the sender send them."""
    if count:
        from .sender import SENDER

        SENDER.wake()


def _stage(wanted, at, *, kind, read):
    if not wanted:
        return 0
    hooks = webhooks_subscribed({event for _pk, event in wanted})
    if not hooks:
        return 0
    shown = read({pk for pk, _event in wanted})
    occurred = rfc3339(at)
    rows = []
    for pk, event in wanted:
        data = shown.get(pk)
        if data is None:
            continue
        for hook in hooks:
            if event in hook.events:
                rows.append(_delivery(hook, event, f"{kind}:{pk}", data, at, occurred))
    Delivery.objects.bulk_create(rows, batch_size=ROWS_PER_INSERT)
    return len(rows)


def _delivery(hook, event, subject, data, at, occurred):
    delivery = Delivery(
        webhook=hook, event=event, subject=subject, occurred_at=at, next_attempt_at=at, retry_until=at + RETRY_WINDOW
    )
    if hook.format == WebhookFormat.SLACK:
        body = {"text": slack_text(event, data)}
    else:
        body = {"id": delivery.delivery_id, "event": event, "occurred_at": occurred, "data": data}
    delivery.body = json.dumps(body, cls=DjangoJSONEncoder, separators=(",", ":"))
    return delivery


def _jobs_shown(pks):
    jobs = Job.objects.filter(pk__in=pks).select_related("training_config", "submitted_by")
    return {row["id"]: _absolute(row) for row in JobSerializer(jobs, many=True).data}


def _workers_shown(pks):
    return {row["id"]: _absolute(row) for row in WorkerSerializer(Worker.objects.filter(pk__in=pks), many=True).data}


def _absolute(row):
    """The object's ``url`` under SIMPLETUNER_PUBLIC_URL when it is set (there is no request to build it from)."""
    if settings.PUBLIC_URL and row.get("url", "").startswith("/"):
        row["url"] = settings.PUBLIC_URL + row["url"]
    return row


def rfc3339(moment):
    """Return ``moment`` (aware) as RFC 3339 in UTC: ``2026-11-28T10:00:00.123456Z``."""
    return moment.isoformat().replace("+00:00", "Z")


def slack_text(event, data):
    """Return the one line a Slack-format webhook gets for ``event`` of a job or worker shown as ``data``."""
    if event == models.WORKER_OFFLINE:
        return f"Worker {data['name']} ({data['id']}) went offline"
    job = f"Job {data['id']} ({data['config_name']})"
    where = f" on {data['worker_name']}" if data.get("worker_name") else ""
    error = f": {data['last_error'][:300]}" if data.get("last_error") else ""
    return {
        models.JOB_COMPLETED: f"{job} completed{where}",
        models.JOB_FAILED: f"{job} failed{where}{error}",
        models.JOB_CANCELLED: f"{job} was cancelled",
        models.JOB_REQUEUED: f"{job} went back to the queue{error}",
    }[event]
