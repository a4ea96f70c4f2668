"""Issue 34, item 5: a submit and an edit of the same unused config version, racing on real PostgreSQL row locks.

Before, the submit read the version unlocked while the admin's edit changed it in place: the job then recorded
version 1, which held other content than the job ran (17 of 100 rounds). Each test holds one side inside its
transaction until the other blocks on the version's row, then lets it go, so the interleaving is the same
every run.
"""

import threading
import time

import pytest
from django.db import connection

from audit.services import Actor
from job_queue import services as job_services
from job_queue.models import Job
from training_configs import services
from training_configs.models import TrainingConfig
from training_configs.services import config_create, config_edit
from tests.services import another_backend_waits_for_a_lock

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

DEADLINE_S = 30
ACTOR = Actor.system("test")
BEFORE = {"learning_rate": 0.0001, "max_train_steps": 100}
AFTER = {"learning_rate": 0.5, "max_train_steps": 9}



def _hold_until_another_waits():
    deadline = time.monotonic() + DEADLINE_S
    while not another_backend_waits_for_a_lock():
        assert time.monotonic() < deadline, "the other side never waited for the config's row"
        time.sleep(0.005)


def _run(first, second, holding):
    """Run ``first`` and, once ``holding`` is set (``first`` holds the row), ``second``, each in a thread."""
    results, errors = {}, []

    def runner(name, function, wait_for=None):
        try:
            if wait_for is not None:
                assert wait_for.wait(DEADLINE_S)
            results[name] = function()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=runner, args=("first", first), daemon=True),
               threading.Thread(target=runner, args=("second", second, holding), daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    if errors:
        raise errors[0]
    return results


def test_an_edit_in_place_that_holds_the_version_makes_the_submit_read_what_it_committed(postgres_url, monkeypatch):
    """The edit has changed the unused version in place and not committed yet when the submit comes: the
    submit waits for it and runs the edited content, which is what version 1 holds."""
    stored = config_create(name="flux-lora", config=BEFORE, actor=ACTOR)
    holding = threading.Event()
    real_audit = services._audit

    def audit_then_hold(action, config, actor, **details):
        real_audit(action, config, actor, **details)
        if threading.current_thread().name == "edit":
            holding.set()
            _hold_until_another_waits()  # the submit is blocked on the version's row

    monkeypatch.setattr(services, "_audit", audit_then_hold)

    def edit():
        threading.current_thread().name = "edit"
        return config_edit(config_id=stored.pk, config=AFTER, dataloader=None, description="", actor=ACTOR)

    results = _run(edit, lambda: job_services.job_submit(config_name="flux-lora", actor=ACTOR), holding)

    (edited, new), (job, _) = results["first"], results["second"]
    assert (edited.version, new) == (1, False)
    job = Job.objects.get(pk=job.pk)
    version = TrainingConfig.objects.get(pk=job.training_config_id)
    assert version.version == 1 and version.used_at is not None
    assert job.config == version.config == AFTER


def test_a_submit_that_holds_the_version_makes_the_edit_a_new_version(postgres_url, monkeypatch):
    """The submit has read and marked version 1 used and not committed yet when the edit comes: the edit waits
    for it, finds the version used and saves version 2; version 1 keeps the content the job runs."""
    config_create(name="flux-lora", config=BEFORE, actor=ACTOR)
    holding = threading.Event()
    real_mark_used = job_services.config_mark_used

    def mark_used_then_hold(config, **kwargs):
        real_mark_used(config, **kwargs)
        holding.set()
        _hold_until_another_waits()  # the edit is blocked on the version's row

    monkeypatch.setattr(job_services, "config_mark_used", mark_used_then_hold)
    version_1 = TrainingConfig.objects.get(name="flux-lora", version=1)

    def edit():
        return config_edit(config_id=version_1.pk, config=AFTER, dataloader=None, description="", actor=ACTOR)

    results = _run(lambda: job_services.job_submit(config_name="flux-lora", actor=ACTOR), edit, holding)

    (job, _), (edited, new) = results["first"], results["second"]
    assert (edited.version, new) == (2, True)
    job = Job.objects.get(pk=job.pk)
    version_1.refresh_from_db()
    assert job.training_config_id == version_1.pk
    assert job.config == version_1.config == BEFORE
    assert TrainingConfig.objects.get(name="flux-lora", version=2).config == AFTER
