"""ASGI entry point: Django set up, then the application the serving package builds (``serving.asgi``)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "simpletuner_site.settings")

import django  # noqa: E402

django.setup(set_prefix=False)

from serving.asgi import build_application  # noqa: E402

application = build_application()
