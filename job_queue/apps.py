from django.apps import AppConfig


class JobQueueConfig(AppConfig):
    name = "job_queue"
    label = "queue"
    verbose_name = "Job queue"

    def ready(self):
        from workers import selectors

        from . import packing

        selectors.HELD_BY = packing.held_by  # what a packing worker holds: the rule's one home, read by the workers app
