"""Prometheus metrics at /metrics: fleet and queue state read from the database, event counters from the services.

Two kinds of metric, so that the figures are right however many processes serve the orchestrator:

- State (workers by status and type, jobs by status, heartbeat age, open streams, the oldest queued
  job, the audit rows not sealed yet) is read from the database by ``DatabaseCollector`` at scrape
  time, in a fixed handful of aggregate queries: the same answer from whichever process is scraped.
- Events (queue wait and dispatch latency histograms, requeues, retries exhausted) are counted in the
  process where they happen, only once their transaction has committed (the job queue's outbox
  events, ``job_queue.events``). With
  ``PROMETHEUS_MULTIPROC_DIR`` set, every process on the host writes them to files there and a scrape
  of any one process sums them all (prometheus_client's multiprocess mode); without it, each process
  reports its own.
"""

import os
import threading
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Min, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpResponse
from django.utils import timezone
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from rest_framework import permissions
from rest_framework.exceptions import NotFound
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.renderers import JSONRenderer
from rest_framework.views import APIView

from audit.selectors import audit_unsealed
from common import outbox
from job_queue import events
from job_queue.models import Job, JobAttempt, JobStatus
from job_queue.usage import usage_totals
from workers.models import WORKER_ONLINE, Worker, WorkerStatus, WorkerType
from workers.services import heartbeat_interval

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# A worker silent for this many heartbeat intervals counts as late (the sweep takes it offline later).
LATE_AFTER_INTERVALS = 2

# --- events, counted where they happen ----------------------------------------------------------

QUEUE_WAIT = Histogram(
    "simpletuner_job_queue_wait_seconds",
    "Time a job waited in the queue before this dispatch: since submission, or since its previous attempt ended.",
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400),
)
DISPATCH_LATENCY = Histogram(
    "simpletuner_job_dispatch_latency_seconds",
    "Time from dispatching a job to its worker's acknowledgement (dispatched -> running).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
REQUEUES = Counter(
    "simpletuner_job_requeues",
    "Jobs put back on the queue after losing an attempt; retry_spent says whether it cost one of its retries.",
    ["retry_spent"],
)
RETRIES_EXHAUSTED = Counter(
    "simpletuner_job_retries_exhausted",
    "Jobs failed for good because their attempt was lost (or failed) with no retry left.",
)
# Both series exist from the start, at 0, so that rate() sees the first requeue.
REQUEUES.labels(retry_spent="true")
REQUEUES.labels(retry_spent="false")


def _seconds_between(start, end):
    return max((end - start).total_seconds(), 0.0)


def on_dispatched(*, job_id, attempt_number, submitted_at, dispatched_at):
    """Observe the queue wait of a job just dispatched (``job_queue.events.DISPATCHED``).

    The wait runs from submission for a first attempt, else from the end of the previous attempt.
    """
    queued_since = submitted_at
    if attempt_number > 1:
        queued_since = (
            JobAttempt.objects.filter(job_id=job_id, number=attempt_number - 1)
            .order_by("pk")  # not the model's ordering, which joins queue_job
            .values_list("finished_at", flat=True)
            .first()
        )
    if queued_since is not None:
        QUEUE_WAIT.observe(_seconds_between(queued_since, dispatched_at))


def on_acknowledged(*, dispatched_at, started_at):
    """Observe the dispatch latency of a job its worker acknowledged (``job_queue.events.ACKNOWLEDGED``)."""
    DISPATCH_LATENCY.observe(_seconds_between(dispatched_at, started_at))


def on_requeued(*, count, retry_spent):
    """Count jobs put back on the queue (``job_queue.events.REQUEUED``)."""
    if count:
        REQUEUES.labels(retry_spent="true" if retry_spent else "false").inc(count)


def on_retries_exhausted(*, count):
    """Count jobs failed for good with no retry left (``job_queue.events.RETRIES_EXHAUSTED``)."""
    if count:
        RETRIES_EXHAUSTED.inc(count)


def subscribe():
    """Count the job queue's events from now on (called once, by the app's ``ready()``)."""
    outbox.subscribe(events.DISPATCHED, on_dispatched)
    outbox.subscribe(events.ACKNOWLEDGED, on_acknowledged)
    outbox.subscribe(events.REQUEUED, on_requeued)
    outbox.subscribe(events.RETRIES_EXHAUSTED, on_retries_exhausted)


# --- state, read from the database at scrape time -----------------------------------------------


class DatabaseCollector(Collector):
    """Fleet, queue, GPU usage and audit-sealing state from five aggregate queries, whatever the number of workers and jobs."""

    def describe(self):
        """Return the (empty) families, so that registering the collector reads nothing."""
        return list(self._families().values())

    @staticmethod
    def _families():
        return {
            "workers": GaugeMetricFamily(
                "simpletuner_workers", "Workers by status and type.", labels=["status", "type"]
            ),
            "jobs": GaugeMetricFamily("simpletuner_jobs", "Jobs by status.", labels=["status"]),
            "heartbeat_age": GaugeMetricFamily(
                "simpletuner_worker_heartbeat_age_max_seconds",
                "Age of the oldest last heartbeat among online workers in each status (0 when there are none).",
                labels=["status"],
            ),
            "late": GaugeMetricFamily(
                "simpletuner_workers_heartbeat_late",
                f"Online workers whose last heartbeat is older than {LATE_AFTER_INTERVALS} heartbeat intervals.",
            ),
            "streams": GaugeMetricFamily(
                "simpletuner_worker_streams_open", "Workers with an open SSE stream (on any server process)."
            ),
            "oldest_queued": GaugeMetricFamily(
                "simpletuner_jobs_queued_oldest_age_seconds",
                "How long the longest-waiting queued job has waited: since submission, or since its last "
                "attempt ended if it was requeued (0 when the queue is empty).",
            ),
            "audit_unsealed": GaugeMetricFamily(
                "simpletuner_audit_unsealed_rows", "Audit rows committed but not sealed into the audit chain yet."
            ),
            "gpu_seconds": CounterMetricFamily(
                "simpletuner_gpu_seconds",
                "GPU-seconds charged to jobs (each attempt's GPUs from its acknowledgement to its end; running ones up "
                "to now), by team and submitting user (empty: none).",
                labels=["team", "user"],
            ),
            "audit_unsealed_age": GaugeMetricFamily(
                "simpletuner_audit_unsealed_oldest_age_seconds",
                "How long ago the oldest audit row not sealed yet was written (0 when every row is sealed).",
            ),
        }

    def collect(self):
        now = timezone.now()
        families = self._families()
        late_cutoff = now - timedelta(seconds=LATE_AFTER_INTERVALS * heartbeat_interval())
        workers = {(status, kind): 0 for status in WorkerStatus.values for kind in WorkerType.values}
        oldest_heartbeat = {}
        late = streams = 0
        for row in (
            Worker.objects.order_by()
            .values("status", "worker_type")
            .annotate(
                n=Count("*"),
                oldest=Min("last_heartbeat"),
                late=Count("pk", filter=Q(last_heartbeat__lt=late_cutoff)),
                streams=Count("pk", filter=Q(stream_id__isnull=False)),
            )
        ):
            workers[row["status"], row["worker_type"]] = row["n"]
            streams += row["streams"]
            if row["status"] in WORKER_ONLINE:
                late += row["late"]
                if row["oldest"] is not None:
                    oldest_heartbeat[row["status"]] = min(row["oldest"], oldest_heartbeat.get(row["status"], now))
        for (status, kind), n in workers.items():
            families["workers"].add_metric([status, kind], n)
        for status in sorted(WORKER_ONLINE):
            since = oldest_heartbeat.get(status)
            families["heartbeat_age"].add_metric([status], _seconds_between(since, now) if since else 0.0)
        families["late"].add_metric([], late)
        families["streams"].add_metric([], streams)

        jobs = dict.fromkeys(JobStatus.values, 0)
        jobs.update(Job.objects.order_by().values_list("status").annotate(n=Count("*")))
        for status, n in jobs.items():
            families["jobs"].add_metric([status], n)

        # A requeued job waits since its last attempt ended (the attempt numbered attempt_count).
        last_attempt_end = (
            JobAttempt.objects.filter(job=OuterRef("pk"), number=OuterRef("attempt_count"))
            .order_by()  # the model's ordering (job) would join queue_job once more
            .values("finished_at")
        )
        oldest = (
            Job.objects.filter(status=JobStatus.QUEUED)
            .order_by()
            .aggregate(since=Min(Coalesce(Subquery(last_attempt_end), "submitted_at")))["since"]
        )
        families["oldest_queued"].add_metric([], _seconds_between(oldest, now) if oldest else 0.0)

        for (team, user), seconds in sorted(usage_totals(now=now).items()):
            families["gpu_seconds"].add_metric([team, user], seconds)

        unsealed, oldest_unsealed = audit_unsealed()
        families["audit_unsealed"].add_metric([], unsealed)
        families["audit_unsealed_age"].add_metric([], _seconds_between(oldest_unsealed, now) if oldest_unsealed else 0.0)
        return list(families.values())


DATABASE_COLLECTOR = DatabaseCollector()
_default_registry_lock = threading.Lock()
_in_default_registry = False


def scrape_registry():
    """Return the registry a scrape reads: every process's events plus the database state.

    With ``PROMETHEUS_MULTIPROC_DIR`` set, a fresh registry summing the files of every process on the
    host; otherwise the process's default registry (its own events, plus process and Python metrics).
    """
    global _in_default_registry
    if os.environ.get(MULTIPROC_DIR_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(DATABASE_COLLECTOR)
        return registry
    with _default_registry_lock:
        if not _in_default_registry:
            REGISTRY.register(DATABASE_COLLECTOR)
            _in_default_registry = True
    return REGISTRY


# --- the endpoint ---------------------------------------------------------------------------------


class ErrorsAsJSON(BaseContentNegotiation):
    """Render errors as JSON whatever the client accepts; the metrics themselves follow Prometheus' negotiation."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class MetricsView(APIView):
    """GET /metrics: Prometheus exposition. Who may read it is ``SIMPLETUNER_METRICS`` (see docs/production.md)."""

    schema = None  # not part of the /api/ OpenAPI description
    renderer_classes = [JSONRenderer]
    content_negotiation_class = ErrorsAsJSON

    @staticmethod
    def _access():
        return settings.SIMPLETUNER["METRICS"]

    def initial(self, request, *args, **kwargs):
        if self._access() == "off":
            raise NotFound("metrics are turned off (SIMPLETUNER_METRICS=off)")
        super().initial(request, *args, **kwargs)

    def get_authenticators(self):
        return [] if self._access() == "public" else super().get_authenticators()

    def get_permissions(self):
        if self._access() == "public":
            return [permissions.AllowAny()]
        return [permissions.IsAuthenticated()]

    def get(self, request):
        encoder, content_type = choose_encoder(request.headers.get("Accept"))
        return HttpResponse(encoder(scrape_registry()), content_type=content_type)
