"""Several jobs on one worker (issue 30, packing): a worker whose agent registered with max_jobs > 1 runs that many
jobs side by side, each on its own GPUs. Driven through the agent's HTTP API, as a packing agent speaks it (a
scripted client); run on PostgreSQL too (DATABASE_URL)."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from job_queue.dispatch import dispatch_for_job, dispatch_pending
from job_queue.models import Job, JobAttempt, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from worker_agent import protocol
from workers.models import Worker, WorkerStatus
from workers.tests.factories import WorkerFactory
from workers.tests.support import sent_events

pytestmark = pytest.mark.django_db


def _register(client, **body):
    return client.post(protocol.REGISTER_PATH, {"name": "packer", "gpu_count": 4, **body})


def _packer(worker_client, commit, *, slots=(0, 1, 2, 3), max_jobs=4, **fields):
    """A worker whose agent registered packing ``max_jobs`` jobs on ``slots``, its stream open."""
    worker = WorkerFactory(gpu_count=len(slots), **fields)
    client = worker_client(worker)
    with commit():
        response = _register(client, max_jobs=max_jobs, gpu_slots=list(slots), gpu_slots_declared=True)
    assert response.status_code == 200, response.json()
    return Worker.objects.get(pk=worker.pk), client, response.json()


def _submits(worker):
    return {e["data"]["job_id"]: e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.JOB_SUBMIT}


def _report(client, job, status, **body):
    job.refresh_from_db()
    return client.post(protocol.job_status_path(job.pk), {"status": status, "attempt": job.lease_id, **body})


# --- registration ---------------------------------------------------------------------------------


def test_a_packing_agent_is_granted_its_max_jobs_and_its_slots_are_stored(worker_client, commit):
    worker, _, answer = _packer(worker_client, commit, slots=(3, 1, 2), max_jobs=3)
    assert answer["max_jobs"] == 3 and answer["resume_jobs"] == [] and answer["abandon_jobs"] == []
    assert (worker.max_jobs, worker.gpu_slots, worker.gpu_slots_declared) == (3, [1, 2, 3], True)
    assert worker.gpu_count == 3 and worker.gpus_free == 3 and worker.status == WorkerStatus.IDLE


def test_an_agent_without_max_jobs_gets_no_packing_answer_and_one_job_at_a_time(worker_client, commit):
    worker = WorkerFactory(gpu_count=4)
    with commit():
        answer = _register(worker_client(worker)).json()
    assert "max_jobs" not in answer and "resume_jobs" not in answer
    worker.refresh_from_db()
    assert (worker.max_jobs, worker.gpus_free, worker.gpu_slots) == (1, 0, [])
    first, second = JobFactory(gpu_count=1), JobFactory(gpu_count=1)
    with commit():
        assert dispatch_for_job(first.pk) is not None
        assert dispatch_for_job(second.pk) is None
    first.refresh_from_db()
    assert first.gpu_indices is None and "gpu_indices" not in _submits(worker)[first.pk]
    assert Worker.objects.get(pk=worker.pk).current_job_id == first.pk


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max_jobs": 0}, "max_jobs"),
        ({"max_jobs": 100000}, "max_jobs"),
        ({"max_jobs": "2"}, "max_jobs"),
        ({"max_jobs": 2, "gpu_slots": [0, 0]}, "gpu_slots"),
        ({"max_jobs": 2, "gpu_slots": [0, -1]}, "gpu_slots"),
        ({"max_jobs": 2, "gpu_slots": [0, 1.5]}, "gpu_slots"),
        ({"max_jobs": 2, "gpu_slots": "0,1"}, "gpu_slots"),
        ({"max_jobs": 2, "gpu_slots": [True]}, "gpu_slots"),
        ({"max_jobs": 2, "running_jobs": [{"attempt": "a_1"}]}, "running_jobs"),
    ],
)
def test_a_registration_with_bad_packing_fields_is_a_400_naming_the_field(worker_client, body, field):
    worker = WorkerFactory()
    response = _register(worker_client(worker), **body)
    assert response.status_code == 400, response.json()
    assert field in str(response.json())
    assert Worker.objects.get(pk=worker.pk).max_jobs == 1


# --- dispatch -------------------------------------------------------------------------------------


def test_four_one_gpu_jobs_run_at_once_on_a_four_gpu_worker_each_on_its_own_gpu(worker_client, commit):
    worker, _, _ = _packer(worker_client, commit)
    jobs = [JobFactory(gpu_count=1) for _ in range(5)]
    with commit():
        for job in jobs:
            dispatch_for_job(job.pk)
    placed = {job.pk: Job.objects.get(pk=job.pk) for job in jobs}
    running = [job for job in placed.values() if job.status == JobStatus.DISPATCHED]
    assert len(running) == 4 and sorted(i for job in running for i in job.gpu_indices) == [0, 1, 2, 3]
    assert placed[jobs[4].pk].status == JobStatus.QUEUED
    submits = _submits(worker)
    assert {pk: submits[pk]["gpu_indices"] for pk in submits} == {job.pk: job.gpu_indices for job in running}
    assert {a.gpu_indices[0] for a in JobAttempt.objects.filter(job__in=running)} == {0, 1, 2, 3}
    worker.refresh_from_db()
    assert (worker.status, worker.gpus_free, worker.current_job_id) == (WorkerStatus.BUSY, 0, None)


def test_a_two_gpu_job_and_two_one_gpu_jobs_share_a_worker(worker_client, commit):
    worker, _, _ = _packer(worker_client, commit)
    big, small_a, small_b = JobFactory(gpu_count=2), JobFactory(gpu_count=1), JobFactory(gpu_count=1)
    with commit():
        dispatch_pending()
    indices = {job.pk: Job.objects.get(pk=job.pk).gpu_indices for job in (big, small_a, small_b)}
    assert indices == {big.pk: [0, 1], small_a.pk: [2], small_b.pk: [3]}
    assert Worker.objects.get(pk=worker.pk).gpus_free == 0


def test_a_job_without_a_gpu_count_waits_for_the_whole_worker_and_takes_it_alone(worker_client, commit):
    worker, client, _ = _packer(worker_client, commit)
    small = JobFactory(gpu_count=1)
    with commit():
        dispatch_for_job(small.pk)
    whole, after = JobFactory(gpu_count=0), JobFactory(gpu_count=1)
    with commit():
        assert dispatch_for_job(whole.pk) is None  # one GPU is held: it waits
        assert dispatch_for_job(after.pk) is not None  # a one-GPU job fits beside
    with commit():
        assert _report(client, small, protocol.COMPLETED).status_code == 200
        assert _report(client, after, protocol.COMPLETED).status_code == 200
    whole.refresh_from_db()
    assert whole.status == JobStatus.DISPATCHED and whole.gpu_indices == [0, 1, 2, 3]
    assert "gpu_indices" not in _submits(worker)[whole.pk]  # absent: the whole worker
    late = JobFactory(gpu_count=1)
    with commit():
        assert dispatch_for_job(late.pk) is None
    assert Worker.objects.get(pk=worker.pk).gpus_free == 0


def test_a_worker_takes_no_more_than_max_jobs_though_gpus_are_free(worker_client, commit):
    worker, _, _ = _packer(worker_client, commit, max_jobs=2)
    jobs = [JobFactory(gpu_count=1) for _ in range(3)]
    with commit():
        dispatch_pending()
    assert sorted(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("status", flat=True)) == [
        JobStatus.DISPATCHED, JobStatus.DISPATCHED, JobStatus.QUEUED
    ]
    assert Worker.objects.get(pk=worker.pk).gpus_free == 0


def test_a_job_that_needs_more_gpus_than_are_free_goes_to_another_worker(worker_client, commit):
    worker, _, _ = _packer(worker_client, commit)
    with commit():
        for job in (JobFactory(gpu_count=2), JobFactory(gpu_count=1)):
            dispatch_for_job(job.pk)
    other = WorkerFactory(gpu_count=4)
    wide = JobFactory(gpu_count=2)
    with commit():
        assert dispatch_for_job(wide.pk).pk == other.pk
    assert Worker.objects.get(pk=worker.pk).gpus_free == 1


# --- reports, per job -----------------------------------------------------------------------------


def test_acks_and_results_are_per_job_and_free_that_jobs_gpus_only(worker_client, commit):
    worker, client, _ = _packer(worker_client, commit)
    first, second = JobFactory(gpu_count=2), JobFactory(gpu_count=1)
    with commit():
        dispatch_pending()
    with commit():
        assert _report(client, first, protocol.STARTING).status_code == 200
        assert _report(client, second, protocol.STARTING).status_code == 200
    assert set(Job.objects.filter(pk__in=[first.pk, second.pk]).values_list("status", flat=True)) == {JobStatus.RUNNING}
    with commit():
        assert _report(client, first, protocol.COMPLETED).status_code == 200
    worker.refresh_from_db()
    first.refresh_from_db()
    assert first.status == JobStatus.COMPLETED and (first.holds_gpus, first.gpu_indices) == (False, [0, 1])
    assert (worker.status, worker.gpus_free) == (WorkerStatus.BUSY, 3)
    with commit():
        assert _report(client, second, protocol.FAILED, error="boom").status_code == 200
    worker.refresh_from_db()
    assert (worker.status, worker.gpus_free) == (WorkerStatus.IDLE, 4)


def test_a_report_under_another_attempt_is_fenced_per_job(worker_client, commit):
    worker, client, _ = _packer(worker_client, commit)
    first, second = JobFactory(gpu_count=1), JobFactory(gpu_count=1)
    with commit():
        dispatch_pending()
    first.refresh_from_db()
    response = client.post(protocol.job_status_path(first.pk), {"status": protocol.RUNNING, "attempt": "a_other"})
    assert response.status_code == 409 and response.json()["code"] == protocol.STALE_ATTEMPT
    assert _report(client, second, protocol.RUNNING).status_code == 200


def test_a_freed_gpu_goes_to_the_next_queued_job_in_the_same_commit(worker_client, commit):
    worker, client, _ = _packer(worker_client, commit, slots=(0, 1), max_jobs=2)
    jobs = [JobFactory(gpu_count=1) for _ in range(3)]
    with commit():
        dispatch_pending()
    running = [j for j in jobs if Job.objects.get(pk=j.pk).status == JobStatus.DISPATCHED]
    waiting = next(j for j in jobs if j not in running)
    freed = Job.objects.get(pk=running[0].pk).gpu_indices
    with commit():
        assert _report(client, running[0], protocol.COMPLETED).status_code == 200
    waiting.refresh_from_db()
    assert waiting.status == JobStatus.DISPATCHED and waiting.gpu_indices == freed


def test_a_released_agents_worker_runs_as_before_beside_a_packing_one(worker_client, commit):
    packer, _, _ = _packer(worker_client, commit)
    plain = WorkerFactory(gpu_count=4)
    job = job_on_worker(plain, gpu_count=1)
    with commit():
        response = worker_client(plain).post(
            protocol.job_status_path(job.pk), {"status": protocol.COMPLETED, "attempt": job.lease_id}
        )
    assert response.status_code == 200
    plain.refresh_from_db()
    assert (plain.status, plain.current_job_id, plain.gpus_free) == (WorkerStatus.IDLE, None, 0)
    assert Worker.objects.get(pk=packer.pk).gpus_free == 4


# --- heartbeats and re-registration, per job ------------------------------------------------------


def _two_running(worker_client, commit):
    worker, client, _ = _packer(worker_client, commit)
    first, second = JobFactory(gpu_count=1), JobFactory(gpu_count=2)
    with commit():
        dispatch_pending()
    first.refresh_from_db()
    second.refresh_from_db()
    return worker, client, first, second


def test_a_heartbeat_with_jobs_acknowledges_each_and_answers_every_job_held(worker_client, commit):
    worker, client, first, second = _two_running(worker_client, commit)
    body = {"status": "busy", "jobs": [{"job_id": first.pk, "attempt": first.lease_id, "progress": {"step": 3}}]}
    with commit():
        answer = client.post(protocol.HEARTBEAT_PATH, body)
    assert answer.status_code == 200, answer.json()
    assert sorted(j["job_id"] for j in answer.json()["jobs"]) == sorted([first.pk, second.pk])
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.status == JobStatus.RUNNING and first.progress == {"step": 3}
    assert second.status == JobStatus.DISPATCHED  # not named: not acknowledged
    stale = {"status": "busy", "jobs": [{"job_id": second.pk, "attempt": "a_old"}]}
    assert client.post(protocol.HEARTBEAT_PATH, stale).status_code == 200
    assert Job.objects.get(pk=second.pk).status == JobStatus.DISPATCHED  # another attempt acknowledges nothing


def test_a_busy_packing_workers_plain_heartbeat_takes_the_full_path(worker_client, commit):
    from job_queue.agents import worker_heartbeat_liveness

    worker, client, first, _ = _two_running(worker_client, commit)
    assert worker_heartbeat_liveness(worker_id=worker.pk, data={"status": "idle"}) is None
    assert worker_heartbeat_liveness(worker_id=worker.pk, data={"jobs": [{"job_id": first.pk}]}) is None
    idle, _, _ = _packer(worker_client, commit)
    assert worker_heartbeat_liveness(worker_id=idle.pk, data={"status": "idle"}) is not None


def test_re_registration_resumes_the_jobs_it_names_and_abandons_the_others(worker_client, commit):
    worker, client, first, second = _two_running(worker_client, commit)
    body = {
        "max_jobs": 4, "gpu_slots": [0, 1, 2, 3],
        "running_jobs": [{"job_id": first.pk, "attempt": first.lease_id}, {"job_id": "j_gone", "attempt": None}],
    }
    with commit():
        answer = _register(client, **body).json()
    assert [j["job_id"] for j in answer["resume_jobs"]] == [first.pk] and answer["abandon_jobs"] == ["j_gone"]
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.status == JobStatus.RUNNING and first.gpu_indices == [0]
    assert second.status == JobStatus.QUEUED or second.worker_id == worker.pk  # requeued (maybe placed again)
    assert JobAttempt.objects.get(job=second, number=1).outcome == "unacknowledged"


# --- loss, drain, cancel, per job -----------------------------------------------------------------


def test_a_disconnect_requeues_every_job_the_worker_held(worker_client, commit):
    worker, client, first, second = _two_running(worker_client, commit)
    with commit():
        assert client.post(protocol.DISCONNECT_PATH, {}).status_code == 200
    worker.refresh_from_db()
    assert (worker.status, worker.gpus_free) == (WorkerStatus.OFFLINE, 0)
    for job in (first, second):
        job.refresh_from_db()
        assert (job.status, job.worker_id, job.gpu_indices) == (JobStatus.QUEUED, None, None)


def test_the_stale_worker_sweep_requeues_every_job_of_a_lost_packing_worker(worker_client, commit):
    from datetime import timedelta

    from django.utils import timezone

    from job_queue.sweeps import sweep_stale_workers
    from workers.models import ServerPresence

    worker, client, first, second = _two_running(worker_client, commit)
    now = timezone.now()
    ServerPresence.objects.create(id="s", hostname="h", pid=1, started_at=now - timedelta(hours=1), last_seen=now)
    Worker.objects.filter(pk=worker.pk).update(last_heartbeat=now - timedelta(hours=1))
    with commit():
        result = sweep_stale_workers(now=now)
    assert result["workers"] == 1 and result["requeued"] == 2
    assert Worker.objects.get(pk=worker.pk).gpus_free == 0
    assert set(Job.objects.filter(pk__in=[first.pk, second.pk]).values_list("gpu_indices", flat=True)) == {None}


def test_draining_names_every_job_and_lets_each_finish(worker_client, commit):
    from audit.services import Actor
    from workers.services import worker_drain

    worker, client, first, second = _two_running(worker_client, commit)
    with commit():
        worker_drain(worker_id=worker.pk, actor=Actor.system("test"))
    drain = [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.DRAIN][-1]
    assert drain["job_ids"] == [first.pk, second.pk] and drain["current_job_id"] == first.pk
    queued = JobFactory(gpu_count=1)
    with commit():
        assert dispatch_for_job(queued.pk) is None
        assert _report(client, first, protocol.COMPLETED).status_code == 200
    assert Worker.objects.get(pk=worker.pk).status == WorkerStatus.DRAINING
    assert Job.objects.get(pk=second.pk).status == JobStatus.DISPATCHED
    with commit():
        assert _report(client, second, protocol.COMPLETED).status_code == 200
    worker.refresh_from_db()
    assert (worker.status, worker.gpus_free) == (WorkerStatus.DRAINING, 4)
    assert Job.objects.get(pk=queued.pk).status == JobStatus.QUEUED


def test_a_cancelled_job_holds_its_gpus_until_its_stop_is_confirmed(worker_client, commit):
    from audit.services import Actor
    from job_queue.services import job_cancel

    worker, client, first, second = _two_running(worker_client, commit)
    with commit():
        job_cancel(job_id=second.pk, actor=Actor.system("test"))
    cancels = [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.JOB_CANCEL]
    assert [(c["job_id"], c["attempt"]) for c in cancels] == [(second.pk, second.lease_id)]
    assert Worker.objects.get(pk=worker.pk).gpus_free == 1
    with commit():
        assert _report(client, second, protocol.CANCELLED).status_code == 200
    assert Worker.objects.get(pk=worker.pk).gpus_free == 3
    assert Job.objects.get(pk=first.pk).status == JobStatus.DISPATCHED


# --- the API --------------------------------------------------------------------------------------


def test_the_worker_and_job_apis_show_free_gpus_and_each_jobs_gpu_indices(worker_client, commit, operator_client):
    worker, client, first, second = _two_running(worker_client, commit)
    detail = operator_client.get(f"/api/admin/workers/{worker.pk}").json()
    assert detail["gpus_free"] == 1 and detail["max_jobs"] == 4
    assert {j["job_id"]: j["gpu_indices"] for j in detail["running_jobs"]} == {first.pk: [0], second.pk: [1, 2]}
    plain = WorkerFactory(gpu_count=2)
    job_on_worker(plain)
    with CaptureQueriesContext(connection) as listing:
        listed = {w["id"]: w for w in operator_client.get("/api/admin/workers").json()["workers"]}
    assert len([q for q in listing.captured_queries if "queue_job" in q["sql"]]) == 1  # one read for every worker
    current = Worker.objects.get(pk=plain.pk).current_job_id
    assert listed[plain.pk]["running_jobs"] == [{"job_id": current, "gpu_indices": None}]
    assert listed[worker.pk]["gpus_free"] == 1 and len(listed[worker.pk]["running_jobs"]) == 2
    job = operator_client.get(f"/api/queue/{second.pk}").json()
    assert job["gpu_indices"] == [1, 2] and job["attempts"][0]["gpu_indices"] == [1, 2]


def test_a_job_waiting_for_gpus_says_how_many_the_fullest_matching_worker_has_free(worker_client, commit):
    from job_queue.selectors import job_waiting_reason

    worker, client, first, second = _two_running(worker_client, commit)  # one of four GPUs free
    wide = JobFactory(gpu_count=2)
    with commit():
        assert dispatch_for_job(wide.pk) is None
    assert job_waiting_reason(Job.objects.get(pk=wide.pk)) == "needs 2 free GPUs; the most free on a matching worker is 1"


def test_the_admin_shows_the_gpus_in_use_per_worker_and_per_job(worker_client, commit, admin_client):
    from django.contrib.admin.utils import quote
    from django.urls import reverse

    worker, client, first, second = _two_running(worker_client, commit)
    workers_page = admin_client.get(reverse("admin:workers_worker_changelist")).content.decode()
    assert "1 free, up to 4 jobs" in workers_page
    assert "GPUs 0</span>" in workers_page and "GPUs 1,2</span>" in workers_page
    job_page = admin_client.get(reverse("admin:queue_job_change", args=[quote(second.pk)])).content.decode()
    assert "GPUs 1,2</span>" in job_page


# --- PostgreSQL: real row locks --------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_job_submitted_while_a_packing_worker_is_held_by_a_report_is_dispatched_once_it_commits(postgres_url):
    """Seen end to end on PostgreSQL: a report of the worker's agent holds its row; a submit's dispatch skips it
    (SKIP LOCKED) and finds no other. After its commit the job waits for that worker's row and takes the free GPU."""
    import threading

    from audit.services import Actor
    from job_queue.services import job_submit
    from job_queue.tests.test_concurrency import DEADLINE_S, holder, run_concurrently
    from workers.services import lock_worker

    worker = WorkerFactory(gpu_count=2, max_jobs=2, gpu_slots=[0, 1])
    first = JobFactory(gpu_count=1)
    dispatch_for_job(first.pk)
    assert Worker.objects.get(pk=worker.pk).gpus_free == 1
    holding, submitted = threading.Event(), threading.Event()

    a_report_holds_the_worker = holder(lambda: lock_worker(worker.pk), holding, submitted)

    def submit():
        assert holding.wait(DEADLINE_S)
        try:
            return job_submit(config_name="cfg", gpu_count=1, actor=Actor.system("operator"))
        finally:
            submitted.set()

    committed, (job, at_once) = run_concurrently([a_report_holds_the_worker, submit])
    assert committed == "committed" and not at_once
    job.refresh_from_db()
    assert (job.status, job.worker_id, job.gpu_indices) == (JobStatus.DISPATCHED, worker.pk, [1])
    assert Worker.objects.get(pk=worker.pk).gpus_free == 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_dispatches_never_give_one_gpu_twice(postgres_url):
    from job_queue.tests.test_concurrency import run_concurrently

    workers = [WorkerFactory(gpu_count=4, max_jobs=4, gpu_slots=[0, 1, 2, 3]) for _ in range(2)]
    jobs = [JobFactory(gpu_count=1 + n % 2) for n in range(10)]
    run_concurrently([lambda job=job: dispatch_for_job(job.pk) for job in jobs])
    for worker in workers:
        placed = Job.objects.filter(worker=worker, holds_gpus=True)
        indices = [i for job in placed for i in job.gpu_indices]
        assert len(indices) == len(set(indices)) and set(indices) <= {0, 1, 2, 3}
        assert Worker.objects.get(pk=worker.pk).gpus_free == 4 - len(indices)


def test_the_first_packing_worker_with_room_is_read_from_its_index_not_sorted():
    from django.utils import timezone

    from job_queue import dispatch
    from job_queue.models import JobTarget
    from job_queue.tests.test_hot_path import _plan

    # A fleet of 2,000: most busy (gpus_free 0, as every worker that does not pack), some packing with room, some idle.
    Worker.objects.bulk_create(
        Worker(
            name=f"w-{i}",
            status=WorkerStatus.IDLE if i % 10 == 0 else WorkerStatus.BUSY,
            stream_id=f"s-{i}",
            gpu_count=4,
            max_jobs=4 if i % 20 == 1 else 1,
            gpus_free=i % 4 if i % 20 == 1 else 0,
            last_job_finished_at=timezone.now(),
        )
        for i in range(2000)
    )
    plan = _plan(dispatch._first_packing_worker_for_job(JobTarget.WORKER, (), gpu_count=2))
    assert "worker_packing_offer" in plan, plan
    assert "Sort" not in plan and "TEMP B-TREE" not in plan, plan


def test_the_ack_sweep_takes_back_unacknowledged_jobs_of_packing_workers_set_based(worker_client, commit):
    from datetime import timedelta

    from django.utils import timezone

    from job_queue.sweeps import sweep_unacknowledged_dispatches
    from workers.models import ServerPresence

    worker, client, first, second = _two_running(worker_client, commit)
    with commit():
        assert _report(client, first, protocol.STARTING).status_code == 200
    now = timezone.now()
    ServerPresence.objects.create(id="s", hostname="h", pid=1, started_at=now - timedelta(hours=1), last_seen=now)
    Job.objects.filter(pk=second.pk).update(dispatched_at=now - timedelta(hours=1))
    with commit():
        assert sweep_unacknowledged_dispatches(now=now) == {"jobs": 1, "workers_freed": 1}
    second.refresh_from_db()
    worker.refresh_from_db()
    assert (second.status, second.attempt_count) == (JobStatus.DISPATCHED, 2)  # requeued, then placed again
    assert JobAttempt.objects.get(job=second, number=1).outcome == "unacknowledged"
    assert Job.objects.get(pk=first.pk).holds_gpus and worker.status == WorkerStatus.BUSY
    held = Job.objects.filter(worker=worker, holds_gpus=True)
    assert worker.gpus_free == 4 - sum(len(job.gpu_indices) for job in held)


# --- an agent replaced, a token rotated, an agent that no longer packs -----------------------------


def test_another_agents_stream_takes_back_every_job_dispatched_to_the_agent_it_replaces(worker_client, commit):
    from job_queue.agents import worker_stream_opened

    worker, client, _ = _packer(worker_client, commit)
    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="stream-old", replaying=False, instance="i-old")
    first, second = JobFactory(gpu_count=1), JobFactory(gpu_count=2)
    with commit():
        dispatch_pending()
    assert Job.objects.filter(worker=worker, holds_gpus=True).count() == 2
    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="stream-new", replaying=False, instance="i-new")
    for job in (first, second):  # taken back without a retry spent, then placed again for the agent that serves now
        job.refresh_from_db()
        assert JobAttempt.objects.get(job=job, number=1).outcome == "unacknowledged"
        assert (job.retry_count, job.attempt_count, job.status, job.holds_gpus) == (0, 2, JobStatus.DISPATCHED, True)


def test_a_forced_token_rotation_requeues_every_job_of_a_packing_worker(worker_client, commit):
    from audit.services import Actor
    from common.errors import Conflict
    from job_queue.fleet import worker_rotate_token

    worker, client, first, second = _two_running(worker_client, commit)
    with pytest.raises(Conflict):
        worker_rotate_token(worker_id=worker.pk, actor=Actor.system("test"))
    with commit():
        _, requeued = worker_rotate_token(worker_id=worker.pk, actor=Actor.system("test"), force=True)
    assert requeued == first.pk
    assert set(Job.objects.filter(pk__in=[first.pk, second.pk]).values_list("status", "retry_count", "holds_gpus")) == {
        (JobStatus.QUEUED, 0, False)
    }
    assert Worker.objects.get(pk=worker.pk).gpus_free == 0


def test_an_agent_that_no_longer_packs_keeps_the_job_it_names_as_its_current_job(worker_client, commit):
    worker, client, first, second = _two_running(worker_client, commit)
    with commit():
        answer = _register(client, current_job_id=second.pk, current_attempt=second.lease_id).json()
    assert answer["resume_job"]["job_id"] == second.pk and "max_jobs" not in answer
    worker.refresh_from_db()
    assert (worker.max_jobs, worker.current_job_id, worker.gpus_free, worker.status) == (1, second.pk, 0, WorkerStatus.BUSY)
    first.refresh_from_db()
    second.refresh_from_db()
    assert not second.holds_gpus and second.status == JobStatus.RUNNING
    assert JobAttempt.objects.get(job=first, number=1).outcome == "unacknowledged"


def test_a_heartbeat_that_no_longer_names_a_cancelled_job_frees_its_gpus(worker_client, commit):
    from audit.services import Actor
    from job_queue.services import job_cancel

    worker, client, first, second = _two_running(worker_client, commit)
    with commit():
        job_cancel(job_id=second.pk, actor=Actor.system("test"))
    body = {"status": "busy", "jobs": [{"job_id": first.pk, "attempt": first.lease_id}]}
    with commit():
        answer = client.post(protocol.HEARTBEAT_PATH, body).json()
    assert answer["jobs"] == [{"job_id": first.pk, "attempt": first.lease_id}]
    worker.refresh_from_db()
    assert (worker.gpus_free, worker.status) == (3, WorkerStatus.BUSY)
    assert not Job.objects.get(pk=second.pk).holds_gpus
