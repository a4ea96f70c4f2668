"""The embedded scheduler: runs the sweeps in-process when no broker (REDIS_URL) is configured.

With Redis, Celery beat runs the very same functions (see ``simpletuner_site.celery``).
"""

import logging
import threading

from django.conf import settings
from django.db import close_old_connections, connection

logger = logging.getLogger(__name__)

STORED_EVENT_TRIM_INTERVAL = 600  # seconds; events are kept 24 h, so a trim every 10 minutes keeps the table lean


def sweep_schedule():
    """Return ``[(task_name, function, interval_seconds)]``: every periodic sweep and how often it runs.

    ``task_name`` is also the name of the Celery task wrapping ``function`` (see each app's tasks.py).
    """
    from artifacts.sweeps import sweep_expired_artifacts
    from audit.sweeps import SEAL_INTERVAL, seal_chain
    from job_queue.dispatch import dispatch_pending
    from job_queue.fairshare import CHARGE_INTERVAL
    from job_queue.sweeps import sweep_fairshare_charge, sweep_stale_workers, sweep_unacknowledged_dispatches
    from realtime.sweeps import trim_stored_events
    from webhooks.sender import SWEEP_INTERVAL as WEBHOOK_INTERVAL
    from webhooks.sweeps import TRIM_INTERVAL as WEBHOOK_TRIM_INTERVAL
    from webhooks.sweeps import deliver_due as deliver_webhooks
    from webhooks.sweeps import trim_deliveries as trim_webhook_deliveries
    from workers.sweeps import sweep_offline_ephemeral_workers

    interval = settings.SIMPLETUNER["HEALTH_CHECK_INTERVAL"]
    # A lost dispatch is caught within 1.5x the acknowledgement timeout, however long the health interval.
    ack_interval = min(interval, settings.SIMPLETUNER["DISPATCH_ACK_TIMEOUT"] / 2)
    return [
        ("queue.sweep_stale_workers", sweep_stale_workers, interval),
        ("queue.sweep_unacknowledged_dispatches", sweep_unacknowledged_dispatches, ack_interval),
        ("workers.sweep_offline_ephemeral_workers", sweep_offline_ephemeral_workers, interval),
        ("queue.dispatch_pending", dispatch_pending, interval),
        ("artifacts.sweep_expired_artifacts", sweep_expired_artifacts, settings.SIMPLETUNER["ARTIFACT_SWEEP_INTERVAL"]),
        # stored worker events older than the replay window (24 h); the library trimmed on every event
        ("realtime.trim_stored_events", trim_stored_events, STORED_EVENT_TRIM_INTERVAL),
        # audit rows a commit's own wake left unsealed (their process stopped first): sealed within a second
        ("audit.seal_chain", seal_chain, SEAL_INTERVAL),
        # webhook deliveries due (retries, and those whose commit's own kick was lost)
        ("webhooks.deliver_due", deliver_webhooks, WEBHOOK_INTERVAL),
        # webhook deliveries ended more than 30 days ago
        ("webhooks.trim_deliveries", trim_webhook_deliveries, WEBHOOK_TRIM_INTERVAL),
        # the GPU time attempts held since the last charge, added to their shares' fair-share usage (lags by this much)
        ("queue.sweep_fairshare_charge", sweep_fairshare_charge, CHARGE_INTERVAL),
    ]


class EmbeddedScheduler:
    """Run each sweep of ``schedule`` every its interval on one daemon thread until ``stop()``."""

    def __init__(self, schedule=None, clock=None):
        import time

        self._schedule = schedule if schedule is not None else sweep_schedule()
        self._clock = clock or time.monotonic
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        self._thread = threading.Thread(target=self._run, name="embedded-sweeps", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout=10):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def run_once(self, name, fn):
        close_old_connections()
        try:
            return fn()
        except Exception:
            logger.exception("sweep %s failed; it runs again at its next interval", name)
            return None
        finally:
            connection.close()

    def _run(self):
        due = {name: self._clock() + interval for name, _, interval in self._schedule}
        while not self._stop.is_set():
            now = self._clock()
            for name, fn, interval in self._schedule:
                if now >= due[name]:
                    self.run_once(name, fn)
                    due[name] = self._clock() + interval
            wait = min(due.values()) - self._clock()
            self._stop.wait(max(wait, 0.05))
