"""Jobs across machines (issue 30, gangs): a job with num_nodes N runs on N workers at once, all or nothing.

Driven through the agent's HTTP API as our agent speaks it (``multi_node`` at registration, a report and heartbeat
per member); the concurrency cases on PostgreSQL too (DATABASE_URL)."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from job_queue.dispatch import dispatch_for_job, dispatch_pending
from job_queue.models import AttemptOutcome, GangMember, Job, JobAttempt, JobStatus
from job_queue.sweeps import sweep_stale_workers, sweep_unacknowledged_dispatches
from job_queue.tests.factories import JobFactory
from worker_agent import protocol
from workers.models import Worker, WorkerStatus
from workers.tests.factories import WorkerFactory
from workers.tests.support import sent_events

pytestmark = pytest.mark.django_db

SUBMIT = "/api/queue/submit"


def _member(worker_client, commit, *, multi_node=True, address=None, **fields):
    """A one-job worker whose agent registered saying it runs multi-node members, its stream open."""
    worker = WorkerFactory(**fields)
    client = worker_client(worker)
    body = {"name": worker.name, "gpu_count": worker.gpu_count}
    if multi_node:
        body["multi_node"] = True
    if address:
        body["advertise_address"] = address
    with commit():
        response = client.post(protocol.REGISTER_PATH, body)
    assert response.status_code == 200, response.json()
    return Worker.objects.get(pk=worker.pk), client


def _fleet(worker_client, commit, n, **fields):
    """``n`` multi-node members, in the order a gang takes them (their ids): rank 0 first."""
    return sorted((_member(worker_client, commit, **fields) for _ in range(n)), key=lambda member: member[0].pk)


def _submits(worker, job_id=None):
    return [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.JOB_SUBMIT and job_id in (None, e["data"]["job_id"])]


def _cancels(worker, job_id):
    return [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.JOB_CANCEL and e["data"]["job_id"] == job_id]


def _report(client, job, status, **body):
    job.refresh_from_db()
    return client.post(protocol.job_status_path(job.pk), {"status": status, "attempt": job.lease_id, **body})


def _dispatched_gang(worker_client, commit, n=2, **job_fields):
    members = _fleet(worker_client, commit, n)
    job = JobFactory(num_nodes=n, gpu_count=1, **job_fields)
    with commit():
        assert dispatch_for_job(job.pk) is not None
    job.refresh_from_db()
    return job, members


# --- submit ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True, None])
def test_num_nodes_that_is_no_whole_number_from_1_is_refused_with_a_reason(operator_client, value):
    WorkerFactory.create_batch(2)
    response = operator_client.post(SUBMIT, {"config_name": "c", "num_nodes": value})
    assert response.status_code == 400, response.content
    assert "num_nodes" in response.json()["errors"], response.json()
    assert Job.objects.count() == 0


def test_num_nodes_above_the_fleets_size_is_refused_naming_it(operator_client):
    WorkerFactory.create_batch(2)
    response = operator_client.post(SUBMIT, {"config_name": "c", "num_nodes": 3})
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "invalid_num_nodes" and "fleet's size, 2" in body["detail"], body
    assert Job.objects.count() == 0


def test_num_nodes_defaults_to_1_and_is_shown(operator_client):
    response = operator_client.post(SUBMIT, {"config_name": "c"})
    assert response.status_code == 201 and response.json()["num_nodes"] == 1


# --- dispatch: all or nothing -----------------------------------------------------------------------------------


def test_a_two_node_job_goes_to_two_multi_node_workers_each_with_its_rank(worker_client, commit, operator_client):
    (first, _), (second, _) = _fleet(worker_client, commit, 2)
    WorkerFactory()  # an agent that never said multi_node (SimpleTuner's released agent) is never a member
    response = operator_client.post(SUBMIT, {"config_name": "c", "num_nodes": 2, "gpu_count": 1})
    assert response.status_code == 201 and response.json()["dispatched"], response.json()
    job = Job.objects.get(pk=response.json()["job_id"])
    assert (job.status, job.worker_id, job.attempt_count) == (JobStatus.DISPATCHED, first.pk, 1)
    low, high = (29500, 29999)
    assert low <= job.master_port <= high
    ranks = {}
    for worker in (first, second):
        worker.refresh_from_db()
        assert (worker.status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)
        (submit,) = _submits(worker)
        ranks[submit["node_rank"]] = worker.pk
        assert (submit["num_nodes"], submit["master_port"], submit["attempt"]) == (2, job.master_port, job.lease_id)
        assert submit["master_addr"] == "127.0.0.1"  # the address it registered from: none advertised
    assert ranks == {0: first.pk, 1: second.pk}
    detail = operator_client.get(f"/api/queue/{job.pk}").json()
    assert [(m["worker_id"], m["rank"], m["gpu_indices"]) for m in detail["members"]] == [(first.pk, 0, None), (second.pk, 1, None)]
    assert detail["attempt_count"] == 1 and len(detail["attempts"]) == 1 and detail["attempts"][0]["worker_id"] == first.pk
    assert JobAttempt.objects.get(job=job).gpus == 2


def test_rank_0s_advertised_address_is_the_master_address(worker_client, commit):
    advertising, _ = _member(worker_client, commit, address="10.0.0.7")
    other, _ = _member(worker_client, commit)
    job = JobFactory(num_nodes=2)
    with commit():
        dispatch_for_job(job.pk)
    expected = "10.0.0.7" if advertising.pk < other.pk else "127.0.0.1"  # rank 0 is the first by id
    assert {s["master_addr"] for w in Worker.objects.all() for s in _submits(w)} == {expected}


def test_a_gang_short_of_workers_takes_none_and_says_what_it_waits_for(worker_client, commit, operator_client):
    (only, _), = _fleet(worker_client, commit, 1, labels={"gpu_type": "a100-80"})
    WorkerFactory(labels={"gpu_type": "a100-40"})  # not multi_node: no member
    job = JobFactory(num_nodes=2, gpu_count=1, worker_labels={"gpu_type": "a100*"})
    with commit():
        assert dispatch_for_job(job.pk) is None
    job.refresh_from_db()
    only.refresh_from_db()
    assert job.status == JobStatus.QUEUED and GangMember.objects.count() == 0
    assert (only.status, only.current_job_id) == (WorkerStatus.IDLE, None)
    reason = operator_client.get(f"/api/queue/{job.pk}").json()["waiting_reason"]
    assert reason.startswith("needs 2 workers with ≥ 1 free GPU matching gpu_type=a100*"), reason
    Worker.objects.filter(pk=only.pk).update(status=WorkerStatus.BUSY)
    _member(worker_client, commit, labels={"gpu_type": "a100-40"})  # its registration offers it the gang: too few
    reason = operator_client.get(f"/api/queue/{job.pk}").json()["waiting_reason"]
    assert reason == "needs 2 workers with ≥ 1 free GPU matching gpu_type=a100*; 1 has room now", reason


def test_an_ephemeral_worker_that_finished_a_job_on_its_stream_is_no_member_it_is_leaving(worker_client, commit):
    """The soak's finding D: a gang took an ephemeral worker between its agent's last report and its disconnect,
    and the attempt died 20-50 ms later. A freed ephemeral worker is offered nothing (it asks, or leaves); nor is it
    a member. A fresh ephemeral agent (its stream opened after that job) is one again."""
    (a, _), (b, _) = _fleet(worker_client, commit, 2, worker_type="ephemeral")
    now = timezone.now()
    Worker.objects.filter(pk=b.pk).update(last_job_finished_at=now, stream_opened_at=now - timedelta(seconds=30))
    job = JobFactory(num_nodes=2, gpu_count=0)
    with commit():
        assert dispatch_for_job(job.pk) is None
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and GangMember.objects.count() == 0

    Worker.objects.filter(pk=b.pk).update(stream_opened_at=now + timedelta(seconds=1))  # a new agent's stream
    with commit():
        assert dispatch_for_job(job.pk) is not None
    assert set(GangMember.objects.values_list("worker_id", flat=True)) == {a.pk, b.pk}


def test_a_one_node_job_is_never_given_to_a_gang_and_a_freed_worker_offers_the_gangs(worker_client, commit):
    (a, a_client), (b, _) = _fleet(worker_client, commit, 2)
    single = JobFactory(gpu_count=1)
    with commit():
        dispatch_for_job(single.pk)
    gang = JobFactory(num_nodes=2, gpu_count=1)
    with commit():
        assert dispatch_for_job(gang.pk) is None  # one worker is busy: the other is not held meanwhile
    assert Worker.objects.get(pk=b.pk).status == WorkerStatus.IDLE
    holder = Worker.objects.get(current_job=single)
    client = a_client if holder.pk == a.pk else worker_client(holder)
    with commit():
        assert _report(client, single, protocol.COMPLETED).status_code == 200
    gang.refresh_from_db()
    assert gang.status == JobStatus.DISPATCHED and GangMember.objects.filter(lease_id=gang.lease_id).count() == 2


# --- acknowledgement, completion ------------------------------------------------------------------------------


def test_the_job_runs_once_every_member_acknowledged_and_completes_once_every_member_completed(worker_client, commit):
    job, [(rank0, c0), (rank1, c1)] = _dispatched_gang(worker_client, commit)
    with commit():
        assert _report(c0, job, protocol.STARTING).status_code == 200
    job.refresh_from_db()
    assert job.status == JobStatus.DISPATCHED
    with commit():  # a heartbeat naming the job and its attempt acknowledges too
        c1.post(protocol.HEARTBEAT_PATH, {"status": "busy", "current_job_id": job.pk, "attempt": job.lease_id})
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING
    with commit():
        assert _report(c1, job, protocol.COMPLETED).status_code == 200
    job.refresh_from_db()
    rank1.refresh_from_db()
    assert job.status == JobStatus.RUNNING and (rank1.status, rank1.current_job_id) == (WorkerStatus.IDLE, None)
    with commit():
        assert _report(c0, job, protocol.COMPLETED, progress={"step": 10}).status_code == 200
    job.refresh_from_db()
    assert job.status == JobStatus.COMPLETED and job.progress["fraction"] == 1.0
    assert JobAttempt.objects.get(job=job).outcome == AttemptOutcome.COMPLETED
    assert set(Worker.objects.values_list("status", flat=True)) == {WorkerStatus.IDLE}


def test_a_report_from_a_worker_that_is_no_member_is_refused_409(worker_client, commit):
    job, _ = _dispatched_gang(worker_client, commit)
    outsider, client = _member(worker_client, commit)
    response = _report(client, job, protocol.COMPLETED)
    assert response.status_code == 409 and response.json()["code"] == protocol.JOB_NOT_OWNED
    job.refresh_from_db()
    assert job.status == JobStatus.DISPATCHED


# --- a member fails or is lost: the whole gang is requeued -----------------------------------------------------


def test_a_failed_member_stops_the_others_and_requeues_the_job_spending_one_retry(worker_client, commit):
    job, [(rank0, c0), (rank1, c1)] = _dispatched_gang(worker_client, commit)
    first_port, first_lease = job.master_port, job.lease_id
    with commit():
        _report(c0, job, protocol.STARTING)
        _report(c1, job, protocol.STARTING)
        assert _report(c1, job, protocol.FAILED, error="NCCL timeout").status_code == 200
    job.refresh_from_db()
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 1), job.last_error
    assert "rank 1" in job.last_error and "NCCL timeout" in job.last_error
    assert _cancels(rank0, job.pk) == [{"type": protocol.JOB_CANCEL, "job_id": job.pk, "attempt": first_lease}]
    outcomes = dict(GangMember.objects.filter(lease_id=first_lease).values_list("rank", "outcome"))
    assert outcomes == {0: "stopped", 1: "failed"}
    # Rank 0's worker stays busy until its agent says it runs the job no more; then the gang goes out again.
    assert Worker.objects.get(pk=rank0.pk).status == WorkerStatus.BUSY
    assert Worker.objects.get(pk=rank1.pk).status == WorkerStatus.IDLE
    assert _report(c0, Job(pk=job.pk, lease_id=first_lease), protocol.CANCELLED).status_code == 409
    named = c0.post(protocol.HEARTBEAT_PATH, {"status": "busy", "current_job_id": job.pk, "attempt": first_lease})
    assert named.status_code == 409 and named.json()["code"] == protocol.JOB_NOT_OWNED  # it stops its copy
    assert Worker.objects.get(pk=rank0.pk).status == WorkerStatus.BUSY
    with commit():
        c0.post(protocol.HEARTBEAT_PATH, {"status": "idle"})
    job.refresh_from_db()
    assert (job.status, job.attempt_count) == (JobStatus.DISPATCHED, 2)
    assert job.lease_id != first_lease and job.master_port != first_port
    assert GangMember.objects.filter(lease_id=job.lease_id).count() == 2


def test_a_member_lost_to_the_heartbeat_timeout_stops_the_others_and_requeues(worker_client, commit, settings):
    job, [(rank0, c0), (rank1, c1)] = _dispatched_gang(worker_client, commit)
    with commit():
        _report(c0, job, protocol.STARTING)
        _report(c1, job, protocol.STARTING)
    lease = job.lease_id
    Worker.objects.filter(pk=rank1.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    with commit():
        assert sweep_stale_workers(now=timezone.now())["requeued"] == 1
    job.refresh_from_db()
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 1)
    assert Worker.objects.get(pk=rank1.pk).status == WorkerStatus.OFFLINE
    assert _cancels(rank0, job.pk)[-1]["attempt"] == lease
    assert dict(GangMember.objects.filter(lease_id=lease).values_list("rank", "outcome")) == {0: "stopped", 1: "lost"}


def test_a_member_whose_agent_disconnects_requeues_the_gang(worker_client, commit):
    job, [(rank0, c0), (rank1, c1)] = _dispatched_gang(worker_client, commit)
    with commit():
        _report(c0, job, protocol.STARTING)
        _report(c1, job, protocol.STARTING)
        assert c0.post(protocol.DISCONNECT_PATH, {}).status_code == 200
    job.refresh_from_db()
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 1)
    assert _cancels(rank1, job.pk) and Worker.objects.get(pk=rank0.pk).status == WorkerStatus.OFFLINE


def test_an_unacknowledged_gang_is_taken_back_as_a_whole(worker_client, commit):
    job, [(rank0, c0), (rank1, _)] = _dispatched_gang(worker_client, commit)
    with commit():
        _report(c0, job, protocol.STARTING)
    Job.objects.filter(pk=job.pk).update(dispatched_at=timezone.now() - timedelta(hours=1))
    with commit():
        assert sweep_unacknowledged_dispatches(now=timezone.now())["jobs"] == 1
    job.refresh_from_db()
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 0)
    assert _cancels(rank0, job.pk) and _cancels(rank1, job.pk)


def test_a_cancel_stops_every_member_and_each_confirmation_frees_its_worker(worker_client, commit, operator_client):
    job, [(rank0, c0), (rank1, c1)] = _dispatched_gang(worker_client, commit)
    with commit():
        assert operator_client.post(f"/api/queue/{job.pk}/cancel").status_code == 200
    assert _cancels(rank0, job.pk) and _cancels(rank1, job.pk)
    with commit():
        assert _report(c1, job, protocol.CANCELLED).status_code == 200
    assert Worker.objects.get(pk=rank1.pk).status == WorkerStatus.IDLE
    assert Worker.objects.get(pk=rank0.pk).status == WorkerStatus.BUSY
    with commit():
        assert _report(c0, job, protocol.CANCELLED).status_code == 200
    assert Worker.objects.get(pk=rank0.pk).status == WorkerStatus.IDLE


# --- the rendezvous port --------------------------------------------------------------------------------------


def test_the_port_is_one_no_other_live_gang_holds_on_the_same_rank_0_worker(worker_client, commit):
    members = _fleet(worker_client, commit, 2, gpu_count=1)
    Worker.objects.update(status=WorkerStatus.IDLE)
    with override_settings(SIMPLETUNER={**__import__("django.conf").conf.settings.SIMPLETUNER, "GANG_PORT_RANGE": (40000, 40001)}):
        rank0 = members[0][0]
        JobFactory(num_nodes=2, status=JobStatus.RUNNING, worker=rank0, master_port=40000, lease_id="a_other")
        job = JobFactory(num_nodes=2)
        with commit():
            dispatch_for_job(job.pk)
        job.refresh_from_db()
        assert job.master_port == 40001


# --- PostgreSQL: real row locks --------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_gangs_never_each_hold_part_of_what_the_other_needs(postgres_url):
    from job_queue.tests.test_concurrency import run_concurrently

    for _ in range(3):
        WorkerFactory(multi_node=True)
    gangs = [JobFactory(num_nodes=2) for _ in range(2)]
    single = JobFactory()
    run_concurrently([lambda job=job: dispatch_for_job(job.pk) for job in [*gangs, single]])
    dispatch_pending()
    statuses = sorted(Job.objects.filter(pk__in=[g.pk for g in gangs]).values_list("status", flat=True))
    assert statuses == [JobStatus.DISPATCHED, JobStatus.QUEUED], statuses
    assert Job.objects.get(pk=single.pk).status == JobStatus.DISPATCHED
    held = Worker.objects.filter(current_job__isnull=False).count()
    assert held == 3 and GangMember.objects.count() == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_gang_gives_up_the_whole_try_when_a_worker_it_needs_is_held(postgres_url):
    import threading

    from job_queue.tests.test_concurrency import DEADLINE_S, holder, run_concurrently
    from workers.services import lock_worker

    first, second = WorkerFactory(multi_node=True), WorkerFactory(multi_node=True)
    job = JobFactory(num_nodes=2)
    holding, tried = threading.Event(), threading.Event()

    def gang():
        assert holding.wait(DEADLINE_S)
        try:
            return dispatch_for_job(job.pk)
        finally:
            tried.set()

    committed, placed = run_concurrently([holder(lambda: lock_worker(second.pk), holding, tried), gang])
    assert committed == "committed" and placed is None
    assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED
    assert Worker.objects.get(pk=first.pk).current_job_id is None


def test_a_forced_token_rotation_of_a_member_other_than_rank_0_stops_the_gang_without_spending_a_retry(worker_client, commit):
    from audit.services import Actor
    from common.errors import Conflict
    from job_queue.fleet import worker_rotate_token

    job, [(rank0, c0), (rank1, c1)] = _dispatched_gang(worker_client, commit)
    with commit():
        _report(c0, job, protocol.STARTING)
        _report(c1, job, protocol.STARTING)
    with pytest.raises(Conflict):  # rank 1 runs the job too: the rotation is refused naming it
        worker_rotate_token(worker_id=rank1.pk, actor=Actor.system("operator"))
    lease = job.lease_id
    with commit():
        assert worker_rotate_token(worker_id=rank1.pk, actor=Actor.system("operator"), force=True)[1] == job.pk
    job.refresh_from_db()
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 0)
    assert _cancels(rank0, job.pk)[-1]["attempt"] == lease
    assert Worker.objects.get(pk=rank1.pk).current_job_id is None


def test_a_member_whose_stream_reopens_before_it_acknowledged_gets_its_own_rank_again(worker_client, commit):
    from job_queue.agents import worker_stream_opened

    job, [(rank0, c0), (rank1, _)] = _dispatched_gang(worker_client, commit)
    with commit():
        _report(c0, job, protocol.STARTING)
    for worker in (rank0, rank1):
        with commit():
            worker_stream_opened(worker_id=worker.pk, stream_id=f"again-{worker.pk}", replaying=False)
    assert len(_submits(rank0, job.pk)) == 1  # rank 0 acknowledged: nothing sent again
    first, again = _submits(rank1, job.pk)
    again.pop("_to_agent")  # addressed to the agent whose stream just opened
    first.pop("_to_agent", None)
    assert again == first and (again["node_rank"], again["num_nodes"], again["master_port"]) == (1, 2, job.master_port)


def test_a_one_node_job_never_reads_or_writes_gang_members_on_its_way(worker_client, commit):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    worker, client = _member(worker_client, commit)
    job = JobFactory(gpu_count=1)
    with CaptureQueriesContext(connection) as queries:
        with commit():
            dispatch_for_job(job.pk)
        with commit():
            _report(client, job, protocol.STARTING)
            client.post(protocol.HEARTBEAT_PATH, {"status": "busy", "current_job_id": job.pk, "attempt": job.lease_id})
            _report(client, job, protocol.COMPLETED)
    job.refresh_from_db()
    assert job.status == JobStatus.COMPLETED
    assert not [q["sql"] for q in queries.captured_queries if "gangmember" in q["sql"]]
