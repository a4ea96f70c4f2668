"""The Celery app: configured from the CELERY_* Django settings (SIMPLETUNER_ENV_FILE read first), tasks found in each
app's tasks.py."""

import os

from celery import Celery

from .env import load_env_file

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "simpletuner_site.settings")
load_env_file()  # SIMPLETUNER_ENV_FILE, before anything reads the environment (the settings, prometheus_client)

app = Celery("simpletuner_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def _beat_schedule():
    """Celery beat runs the same sweep functions, on the same intervals, as the embedded scheduler.

    A run not started within its interval expires (the next is already due): a Celery worker that was down
    does not come back to a queue of thousands of audit.seal_chain runs, one a second.
    """
    import django

    django.setup()
    from .scheduler import sweep_schedule

    return {
        task: {"task": task, "schedule": interval, "options": {"expires": interval}}
        for task, _fn, interval in sweep_schedule()
    }


app.conf.beat_schedule = _beat_schedule()
