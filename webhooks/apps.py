from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    """Subscribes the webhooks to job and worker status changes: deliveries staged in the changing transaction."""

    name = "webhooks"
    verbose_name = "Webhooks"

    def ready(self):
        from common import outbox
        from job_queue.events import STATUS_CHANGED as JOBS_CHANGED
        from workers.events import STATUS_CHANGED as WORKERS_CHANGED

        from . import staging

        outbox.subscribe_staged(JOBS_CHANGED, stage=staging.stage_jobs, publish=staging.published, order=staging.order)
        outbox.subscribe_staged(WORKERS_CHANGED, stage=staging.stage_workers, publish=staging.published, order=staging.order)
