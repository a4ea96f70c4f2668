from django.apps import AppConfig


class RealtimeConfig(AppConfig):
    """Installs our listener manager and subscribes the streams to the apps' outbox topics."""

    name = "realtime"
    verbose_name = "Realtime"

    def ready(self):
        from audit.events import CHANGES
        from common import outbox
        from workers.accounts import ACCESS_CHANGED
        from workers.events import STREAMS_REVOKED, WORKER_EVENT

        from . import listeners, operator_feed, publish

        listeners.install_listener_manager()
        outbox.subscribe_staged(
            WORKER_EVENT, stage=publish.stage_worker_event, publish=publish.publish_worker_event, order=publish.worker_event_order
        )
        outbox.subscribe(STREAMS_REVOKED, publish.on_streams_revoked)
        outbox.subscribe(CHANGES, operator_feed.on_changes)
        outbox.subscribe(ACCESS_CHANGED, operator_feed.on_access_changed)
