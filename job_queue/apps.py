from django.apps import AppConfig


class JobQueueConfig(AppConfig):
    name = "job_queue"
    label = "queue"
    verbose_name = "Job queue"
