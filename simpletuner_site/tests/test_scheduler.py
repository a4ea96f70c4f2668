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
