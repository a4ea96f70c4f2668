"""The orchestrator's Django project. The Celery app lives in ``simpletuner_site.celery`` (``celery -A simpletuner_site.celery``)."""
