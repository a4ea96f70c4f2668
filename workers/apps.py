from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Workers"

    def ready(self):
        from . import receivers
        from .api import schema  # noqa: F401  registers the OpenAPI authentication extensions

        receivers.connect()  # account changes and sign-ins audited (workers.accounts), failed sign-ins throttled
