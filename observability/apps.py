from django.apps import AppConfig


class ObservabilityConfig(AppConfig):
    """Counts the job queue's outbox events (``job_queue.events``) into the Prometheus metrics."""

    name = "observability"
    verbose_name = "Observability"

    def ready(self):
        from . import metrics

        metrics.subscribe()
