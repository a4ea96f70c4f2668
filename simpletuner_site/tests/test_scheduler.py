"""The embedded scheduler and Celery beat run the same sweeps on the same intervals."""

import threading

import pytest

from simpletuner_site.scheduler import EmbeddedScheduler, sweep_schedule


def test_beat_schedule_and_embedded_schedule_are_one_list():
    from simpletuner_site.celery import app

    app.loader.import_default_modules()  # what a Celery worker does at start: imports each tasks.py
    embedded = {name: interval for name, _fn, interval in sweep_schedule()}
    beat = {name: entry["schedule"] for name, entry in app.conf.beat_schedule.items()}
    assert beat == embedded
    assert {entry["task"] for entry in app.conf.beat_schedule.values()} <= set(app.tasks)
    # a run not started within its interval is dropped, not queued behind the next ones
    assert all(entry["options"]["expires"] == entry["schedule"] for entry in app.conf.beat_schedule.values())


def test_every_sweep_is_scheduled_on_the_health_interval_and_the_ack_sweep_within_half_its_timeout(settings):
    from artifacts.sweeps import sweep_expired_artifacts
    from audit.sweeps import seal_chain
    from job_queue.dispatch import dispatch_pending
    from job_queue.sweeps import sweep_fairshare_charge, sweep_stale_workers, sweep_unacknowledged_dispatches
    from realtime.sweeps import trim_stored_events
    from webhooks.sweeps import deliver_due, trim_deliveries
    from workers.sweeps import sweep_offline_ephemeral_workers

    settings.SIMPLETUNER = {
        **settings.SIMPLETUNER, "HEALTH_CHECK_INTERVAL": 60, "DISPATCH_ACK_TIMEOUT": 60, "ARTIFACT_SWEEP_INTERVAL": 3600,
    }
    assert sweep_schedule() == [
        ("queue.sweep_stale_workers", sweep_stale_workers, 60),
        ("queue.sweep_unacknowledged_dispatches", sweep_unacknowledged_dispatches, 30),
        ("workers.sweep_offline_ephemeral_workers", sweep_offline_ephemeral_workers, 60),
        ("queue.dispatch_pending", dispatch_pending, 60),
        ("artifacts.sweep_expired_artifacts", sweep_expired_artifacts, 3600),  # its own interval
        ("realtime.trim_stored_events", trim_stored_events, 600),  # a fixed interval: events are kept 24 h
        ("audit.seal_chain", seal_chain, 1),  # within the sealing lag's target (1 s), whatever the health interval
        ("webhooks.deliver_due", deliver_due, 5),  # retries sent within 5 s of falling due
        ("webhooks.trim_deliveries", trim_deliveries, 3600),
        ("queue.sweep_fairshare_charge", sweep_fairshare_charge, 30),  # fair-share usage lags by 30 s at most
    ]
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEALTH_CHECK_INTERVAL": 20, "DISPATCH_ACK_TIMEOUT": 300}
    assert {name: interval for name, _fn, interval in sweep_schedule()} == {
        "queue.sweep_stale_workers": 20,
        "queue.sweep_unacknowledged_dispatches": 20,
        "workers.sweep_offline_ephemeral_workers": 20,
        "queue.dispatch_pending": 20,
        "artifacts.sweep_expired_artifacts": 3600,
        "realtime.trim_stored_events": 600,
        "audit.seal_chain": 1,
        "webhooks.deliver_due": 5,
        "webhooks.trim_deliveries": 3600,
        "queue.sweep_fairshare_charge": 30,
    }


def test_each_celery_task_is_the_sweep_of_the_same_name():
    from simpletuner_site.celery import app

    app.loader.import_default_modules()
    for name, fn, _interval in sweep_schedule():
        task = app.tasks[name]
        assert task.__module__ == fn.__module__.replace(".sweeps", ".tasks").replace(".dispatch", ".tasks")
        assert task.__name__ == fn.__name__


@pytest.mark.django_db
def test_embedded_scheduler_runs_each_sweep_and_survives_a_failing_one():
    ran = threading.Event()
    calls = []

    def boom():
        calls.append("boom")
        raise RuntimeError("sweep failed")

    def ok():
        calls.append("ok")
        if calls.count("ok") >= 2:
            ran.set()

    scheduler = EmbeddedScheduler(schedule=[("boom", boom, 0.01), ("ok", ok, 0.01)]).start()
    try:
        assert ran.wait(10), calls
    finally:
        scheduler.stop()
    assert calls.count("boom") >= 1
