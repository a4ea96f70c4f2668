"""Issue 34, item 3: a worker cannot grow the audit log without bound with its own valid token.

Refusals it provokes (heartbeats and reports naming jobs or attempts it does not hold, claims to be another
worker) and its registrations are counted per worker at the failed-authentication rate, audited in the
same bounded form (the window's first refusal with the count of the window before, and one
``worker.throttled`` row when the rate is crossed). The answer to a stale report stays the protocol's 409
(``job_not_owned`` / ``stale_attempt`` with ``abandon_job``), which the agent needs to stop its copy;
claims and registrations past the rate get 429 with Retry-After.
"""

import pytest

from audit import actions
from audit.models import AuditEvent
from job_queue.models import JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers import throttling
from workers.models import WorkerStatus
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

HEARTBEAT = "/api/workers/heartbeat"
REGISTER = "/api/workers/register"
DISCONNECT = "/api/workers/disconnect"
RATE = 30  # the shipped SIMPLETUNER_FAILED_AUTH_RATE, a minute
UPSTREAM = {"name": "gpu-worker-1", "gpu_info": {"name": "A100", "vram_gb": 80.0, "count": 1}, "persistent": True}


@pytest.fixture(autouse=True)
def rate(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"failed_auth": f"{RATE}/min"}}


@pytest.fixture
def clock(monkeypatch):
    """The throttle's clock, in seconds, 10 s into a minute; ``clock[0] += 60`` moves it on a window."""
    now = [1_699_999_990.0]
    monkeypatch.setattr(throttling.FailedAuthenticationThrottle, "timer", lambda self: now[0])
    return now


def _new_rows(before):
    return list(AuditEvent.objects.filter(pk__gt=before).order_by("pk"))


def _last_row():
    return AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0


def test_500_heartbeats_naming_a_job_not_held_each_get_409_and_add_two_audit_rows(worker_client, clock):
    worker = WorkerFactory()
    others = JobFactory()
    client = worker_client(worker)
    before = _last_row()

    answers = [client.post(HEARTBEAT, {"worker_id": worker.pk, "current_job_id": others.pk}, REMOTE_ADDR="10.0.0.5")
               for _ in range(500)]

    assert {a.status_code for a in answers} == {409}
    assert {(a.json()["code"], a.json()["abandon_job"]) for a in answers} == {("job_not_owned", others.pk)}
    first, throttled = _new_rows(before)
    assert (first.action, first.target_id, first.success) == (actions.JOB_REPORT_REFUSED, others.pk, False)
    assert first.details == {"reported": "heartbeat", "reason": "job_not_owned", "worker": worker.pk,
                             "refusals_in_previous_window": 0}
    assert (throttled.action, throttled.target_id, throttled.client_ip) == (actions.WORKER_THROTTLED, worker.pk, "10.0.0.5")
    assert throttled.details == {"what": "refusals", "count": RATE + 1, "window_seconds": 60, "retry_after": 50}

    clock[0] += 60  # the next window: its first refusal says how many the last one had
    assert client.post(HEARTBEAT, {"current_job_id": others.pk}).status_code == 409
    (next_first,) = _new_rows(throttled.pk)
    assert next_first.details["refusals_in_previous_window"] == 500


def test_wrong_attempt_and_not_owned_reports_each_get_409_and_are_counted_together(worker_client, clock):
    worker = WorkerFactory()
    mine = job_on_worker(worker, status=JobStatus.RUNNING)
    others = JobFactory()
    client = worker_client(worker)
    before = _last_row()

    stale = [client.post(f"/api/workers/job/{mine.pk}/status", {"status": "running", "attempt": "a_old"}) for _ in range(100)]
    not_owned = [client.post(f"/api/workers/job/{others.pk}/status", {"status": "completed"}) for _ in range(100)]

    assert {(a.status_code, a.json()["code"], a.json()["abandon_job"]) for a in stale} == {(409, "stale_attempt", mine.pk)}
    assert {(a.status_code, a.json()["code"]) for a in not_owned} == {(409, "job_not_owned")}
    assert [row.action for row in _new_rows(before)] == [actions.JOB_REPORT_REFUSED, actions.WORKER_THROTTLED]
    mine.refresh_from_db()
    assert mine.status == JobStatus.RUNNING


def test_a_refusing_worker_does_not_throttle_another(worker_client, clock):
    noisy, quiet = WorkerFactory(), WorkerFactory()
    others = JobFactory()
    for _ in range(RATE + 5):
        worker_client(noisy).post(HEARTBEAT, {"current_job_id": others.pk})

    answer = worker_client(quiet).post(HEARTBEAT, {"current_job_id": others.pk})

    assert answer.status_code == 409
    assert len(audit_rows(actions.JOB_REPORT_REFUSED, actor_id=quiet.pk)) == 1


def test_claims_to_be_another_worker_are_403_then_429_and_add_two_audit_rows(worker_client, clock):
    worker, other = WorkerFactory(fresh=True), WorkerFactory()
    client = worker_client(worker)
    before = _last_row()

    answers = [client.post(REGISTER, {**UPSTREAM, "worker_id": other.pk}) for _ in range(100)]

    assert [a.status_code for a in answers] == [403] * RATE + [429] * (100 - RATE)
    assert answers[-1]["Retry-After"] == "50" and answers[-1].json()["code"] == "throttled"
    first, throttled = _new_rows(before)
    assert (first.action, first.details["refusals_in_previous_window"]) == (actions.WORKER_REGISTRATION_FAILED, 0)
    assert (throttled.action, throttled.details["what"]) == (actions.WORKER_THROTTLED, "refusals")
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.CONNECTING


def test_register_disconnect_cycles_are_throttled_so_their_rows_are_bounded(worker_client, clock):
    worker = WorkerFactory(fresh=True)
    client = worker_client(worker)
    before = _last_row()

    registers = []
    for _ in range(100):
        registers.append(client.post(REGISTER, UPSTREAM))
        client.post(DISCONNECT, {"worker_id": worker.pk})

    assert [r.status_code for r in registers] == [200] * RATE + [429] * (100 - RATE)
    rows = _new_rows(before)
    assert len(audit_rows(actions.WORKER_REGISTERED)) == RATE
    assert len(audit_rows(actions.WORKER_DISCONNECTED)) == RATE  # one a cycle: a disconnect that changes nothing writes none
    assert [row.details["what"] for row in rows if row.action == actions.WORKER_THROTTLED] == ["registrations"]
    assert len(rows) <= RATE * 4 + 1  # before: 4 rows a cycle, 400 for 100 cycles

    clock[0] += 60  # the next window registers again
    assert client.post(REGISTER, UPSTREAM).status_code == 200


def test_a_disconnect_that_changes_nothing_writes_no_row(worker_client):
    worker = WorkerFactory(offline=True)
    before = _last_row()

    answers = [worker_client(worker).post(DISCONNECT, {}) for _ in range(20)]

    assert {a.json()["status"] for a in answers} == {"offline"}
    assert _new_rows(before) == []
