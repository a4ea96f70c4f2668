"""Gang members on packing workers (issue 30): a worker whose agent packs (max_jobs > 1) with ``gpu_count`` free GPUs
and a free job slot may run a member of a multi-node job beside the jobs it runs, on its lowest free GPUs, held until
its agent says it runs the job no more. Driven through the agent's HTTP API as our packing agent speaks it; the race
with a packed dispatch on PostgreSQL too (DATABASE_URL)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from job_queue import gangs, packing
from job_queue.dispatch import dispatch_for_job
from job_queue.models import GangMember, Job, JobStatus
from job_queue.sweeps import sweep_stale_workers
from job_queue.tests.factories import JobFactory
from worker_agent import protocol
from workers.models import Worker, WorkerStatus
from workers.tests.factories import WorkerFactory
from workers.tests.support import sent_events

pytestmark = pytest.mark.django_db


def _packer(worker_client, commit, *, slots=(0, 1)):
    """A worker whose agent packs (one job per slot), runs multi-node members, and has its stream open."""
    worker = WorkerFactory(gpu_count=len(slots))
    client = worker_client(worker)
    body = {
        "name": worker.name, "gpu_count": len(slots), "max_jobs": len(slots), "gpu_slots": list(slots),
        "gpu_slots_declared": True, "multi_node": True,
    }
    with commit():
        response = client.post(protocol.REGISTER_PATH, body)
    assert response.status_code == 200, response.json()
    return Worker.objects.get(pk=worker.pk), client


def _busy_packers(worker_client, commit, n=2):
    """``n`` two-slot packing workers (gang order: by id), each running a one-GPU job on GPU 0; return them and the jobs."""
    fleet = sorted((_packer(worker_client, commit) for _ in range(n)), key=lambda member: member[0].pk)
    packed = []
    for worker, _ in fleet:
        job = JobFactory(gpu_count=1)
        with commit():
            assert dispatch_for_job(job.pk).pk == worker.pk
        packed.append(Job.objects.get(pk=job.pk))
    assert [job.gpu_indices for job in packed] == [[0]] * n
    return fleet, packed


def _submit(worker, job_id):
    return [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.JOB_SUBMIT and e["data"]["job_id"] == job_id]


def _cancels(worker, job_id):
    return [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.JOB_CANCEL and e["data"]["job_id"] == job_id]


def _report(client, job, status, **body):
    job.refresh_from_db()
    return client.post(protocol.job_status_path(job.pk), {"status": status, "attempt": job.lease_id, **body})


def _heartbeat(client, jobs):
    """A packing agent's heartbeat naming ``jobs`` (each ``(job, attempt)``)."""
    body = {"status": "busy" if jobs else "idle", "jobs": [{"job_id": job.pk, "attempt": attempt} for job, attempt in jobs]}
    response = client.post(protocol.HEARTBEAT_PATH, body)
    assert response.status_code == 200, response.json()
    return response.json()


def _free(worker):
    return Worker.objects.get(pk=worker.pk).gpus_free


def _gang(commit, *, gpu_count=1):
    gang = JobFactory(num_nodes=2, gpu_count=gpu_count)
    with commit():
        dispatch_for_job(gang.pk)
    return Job.objects.get(pk=gang.pk)


def test_a_gang_runs_across_two_packing_workers_beside_the_one_gpu_job_each_runs(worker_client, commit):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    assert (gang.status, gang.worker_id, gang.holds_gpus) == (JobStatus.DISPATCHED, a.pk, False)  # rank 0 is a's
    members = list(GangMember.objects.filter(lease_id=gang.lease_id).order_by("rank").values_list("worker_id", "gpu_indices", "holds_gpus"))
    assert members == [(a.pk, [1], True), (b.pk, [1], True)]
    for rank, worker in enumerate((a, b)):
        [sent] = _submit(worker, gang.pk)
        assert (sent["node_rank"], sent["num_nodes"], sent["gpu_indices"]) == (rank, 2, [1])
        assert _free(worker) == 0 and Worker.objects.get(pk=worker.pk).status == WorkerStatus.BUSY
        # What it holds: its packed job and the member, each on its own GPU (rank 0's counted once).
        assert sorted((job.pk, job.gpu_indices) for job in packing.held_jobs(worker.pk)) == sorted(
            [(packed[rank].pk, [0]), (gang.pk, [1])]
        )
    with commit():
        for client, job in ((ca, packed[0]), (cb, packed[1])):
            answer = _heartbeat(client, [(job, job.lease_id), (gang, gang.lease_id)])
            assert {item["job_id"] for item in answer["jobs"]} == {job.pk, gang.pk}
    gang.refresh_from_db()
    assert gang.status == JobStatus.RUNNING
    with commit():
        assert _report(ca, gang, protocol.COMPLETED).status_code == 200
        assert _free(a) == 1 and _free(b) == 0  # each member gives its GPU back as it ends
        assert _report(cb, gang, protocol.COMPLETED).status_code == 200
    gang.refresh_from_db()
    assert gang.status == JobStatus.COMPLETED
    assert (_free(a), _free(b)) == (1, 1)
    assert not GangMember.objects.filter(holds_gpus=True).exists()
    assert Job.objects.filter(pk__in=[job.pk for job in packed], status=JobStatus.RUNNING, holds_gpus=True).count() == 2


def test_the_worker_api_lists_a_member_with_its_gpus(worker_client, commit, operator_client):
    [(a, _), _], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    detail = operator_client.get(f"/api/admin/workers/{a.pk}").json()
    assert detail["gpus_free"] == 0
    assert sorted((job["job_id"], job["gpu_indices"]) for job in detail["running_jobs"]) == sorted(
        [(packed[0].pk, [0]), (gang.pk, [1])]
    )
    listed = {w["id"]: w for w in operator_client.get("/api/admin/workers").json()["workers"]}
    assert sorted(job["job_id"] for job in listed[a.pk]["running_jobs"]) == sorted([packed[0].pk, gang.pk])


def test_the_admin_shows_a_members_gpus_on_its_packing_worker(worker_client, commit, admin_client):
    from django.urls import reverse

    _busy_packers(worker_client, commit)
    _gang(commit)
    workers_page = admin_client.get(reverse("admin:workers_worker_changelist")).content.decode()
    assert workers_page.count("GPUs 0</span>") == 2 and workers_page.count("GPUs 1</span>") == 2


def test_a_packing_member_whose_stream_reopens_before_it_acknowledged_gets_its_rank_and_gpus_again(worker_client, commit):
    from job_queue.agents import worker_stream_opened

    [(a, _), (b, _)], _ = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    with commit():
        worker_stream_opened(worker_id=b.pk, stream_id=f"again-{b.pk}", replaying=False)
    first, again = _submit(b, gang.pk)
    again.pop("_to_agent")  # addressed to the agent whose stream just opened
    first.pop("_to_agent", None)
    assert again == first and (again["node_rank"], again["gpu_indices"]) == (1, [1])


def test_a_two_gpu_gang_waits_on_workers_with_one_free_gpu_and_runs_when_their_jobs_end(worker_client, commit):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit, gpu_count=2)
    assert gang.status == JobStatus.QUEUED and not GangMember.objects.exists()
    assert gangs.waiting_reason(gang) == "needs 2 workers with ≥ 2 free GPU; 0 have room now"
    with commit():
        assert _report(ca, packed[0], protocol.COMPLETED).status_code == 200
    gang.refresh_from_db()
    assert gang.status == JobStatus.QUEUED and _free(a) == 2
    assert gangs.waiting_reason(gang) == "needs 2 workers with ≥ 2 free GPU; 1 has room now"
    with commit():  # the room freed is offered to the queued gangs at once
        assert _report(cb, packed[1], protocol.COMPLETED).status_code == 200
    gang.refresh_from_db()
    assert gang.status == JobStatus.DISPATCHED
    assert sorted(GangMember.objects.filter(lease_id=gang.lease_id).values_list("gpu_indices", flat=True)) == [[0, 1], [0, 1]]
    assert (_free(a), _free(b)) == (0, 0)


def test_a_one_gpu_gang_counts_a_packing_worker_with_room_while_it_waits(worker_client, commit):
    _packer(worker_client, commit)
    gang = _gang(commit)
    assert gang.status == JobStatus.QUEUED
    assert gangs.waiting_reason(gang) == "needs 2 workers with ≥ 1 free GPU; only 1 such worker(s) whose agent runs multi-node jobs are registered"
    _packer(worker_client, commit)  # its registration offers the queued gangs its room
    gang.refresh_from_db()
    assert gang.status == JobStatus.DISPATCHED


def test_a_whole_worker_gang_takes_a_packing_worker_only_while_it_holds_nothing(worker_client, commit):
    [(a, ca), (b, _)], packed = _busy_packers(worker_client, commit, n=2)
    gang = _gang(commit, gpu_count=0)
    assert gang.status == JobStatus.QUEUED  # each has a free GPU and slot, but a job on it
    with commit():
        _report(ca, packed[0], protocol.COMPLETED)
    (c, _) = _packer(worker_client, commit)
    gang.refresh_from_db()
    assert gang.status == JobStatus.DISPATCHED
    members = dict(GangMember.objects.filter(lease_id=gang.lease_id).values_list("worker_id", "gpu_indices"))
    assert members == {a.pk: [0, 1], c.pk: [0, 1]}
    assert all("gpu_indices" not in sent for sent in _submit(a, gang.pk))  # the whole worker: as a packed job's
    assert _free(a) == 0


def test_a_stopped_member_keeps_its_gpus_until_its_agent_runs_the_job_no_more(worker_client, commit):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    first = gang.lease_id
    with commit():
        _heartbeat(ca, [(packed[0], packed[0].lease_id), (gang, first)])
        _heartbeat(cb, [(packed[1], packed[1].lease_id), (gang, first)])
        assert _report(cb, gang, protocol.FAILED, error="NCCL timeout").status_code == 200
    gang.refresh_from_db()
    assert (gang.status, gang.retry_count) == (JobStatus.QUEUED, 1)
    assert _cancels(a, gang.pk)[-1]["attempt"] == first
    assert _free(b) == 1 and _free(a) == 0  # b's agent said so (its report); a's member was told to stop
    # a's agent still names it: the answer holds the job no more (the agent stops it), and its GPU stays held.
    with commit():
        answer = _heartbeat(ca, [(packed[0], packed[0].lease_id), (gang, first)])
    assert [item["job_id"] for item in answer["jobs"]] == [packed[0].pk]
    assert _free(a) == 0 and GangMember.objects.get(lease_id=first, worker=a).holds_gpus
    gang.refresh_from_db()
    assert gang.status == JobStatus.QUEUED  # no GPU given twice: a's is not free yet
    with commit():  # it runs it no more: the GPU is given back and offered at once (the gang goes out again)
        _heartbeat(ca, [(packed[0], packed[0].lease_id)])
    assert not GangMember.objects.get(lease_id=first, worker=a).holds_gpus
    gang.refresh_from_db()
    assert (gang.status, gang.attempt_count) == (JobStatus.DISPATCHED, 2)
    assert sorted(GangMember.objects.filter(lease_id=gang.lease_id, holds_gpus=True).values_list("gpu_indices", flat=True)) == [[1], [1]]


def test_a_cancelled_gangs_members_hold_their_gpus_until_each_agent_confirms(worker_client, commit, operator_client):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    with commit():
        assert operator_client.post(f"/api/queue/{gang.pk}/cancel").status_code == 200
    assert _cancels(a, gang.pk) and _cancels(b, gang.pk)
    assert (_free(a), _free(b)) == (0, 0)
    with commit():
        assert _report(ca, gang, protocol.CANCELLED).status_code == 200  # a confirms by its report
    assert (_free(a), _free(b)) == (1, 0)
    with commit():  # b confirms by a heartbeat that no longer names it
        _heartbeat(cb, [(packed[1], packed[1].lease_id)])
    assert (_free(a), _free(b)) == (1, 1)
    assert not GangMember.objects.filter(holds_gpus=True).exists()


def test_a_stopped_members_report_is_refused_and_gives_its_gpus_back(worker_client, commit):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    first = gang.lease_id
    with commit():
        assert _report(cb, gang, protocol.FAILED, error="boom").status_code == 200
    stale = ca.post(protocol.job_status_path(gang.pk), {"status": protocol.CANCELLED, "attempt": first})
    assert stale.status_code == 409 and stale.json()["code"] == protocol.JOB_NOT_OWNED
    assert not GangMember.objects.get(lease_id=first, worker=a).holds_gpus and _free(a) >= 1


def test_a_lost_packing_worker_requeues_its_jobs_and_ends_the_gang_attempt_it_was_in(worker_client, commit):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    lease = gang.lease_id
    Worker.objects.filter(pk=b.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    with commit():
        result = sweep_stale_workers(now=timezone.now())
    assert result["workers"] == 1 and result["requeued"] == 2  # its packed job and the gang (once, as a whole)
    gang.refresh_from_db()
    assert (gang.status, gang.retry_count) == (JobStatus.QUEUED, 0)  # never acknowledged: no retry spent
    assert Job.objects.get(pk=packed[1].pk).status in (JobStatus.QUEUED, JobStatus.DISPATCHED)
    assert dict(GangMember.objects.filter(lease_id=lease).values_list("rank", "outcome")) == {0: "stopped", 1: "lost"}
    assert _cancels(a, gang.pk)[-1]["attempt"] == lease
    lost = Worker.objects.get(pk=b.pk)
    assert (lost.status, lost.gpus_free) == (WorkerStatus.OFFLINE, 0)
    assert not GangMember.objects.filter(worker=b, holds_gpus=True).exists()
    assert GangMember.objects.get(lease_id=lease, worker=a).holds_gpus  # until a's agent says it stopped
    assert _free(a) == 0


def test_a_disconnecting_packing_member_requeues_the_gang_and_frees_its_gpus(worker_client, commit):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    lease = gang.lease_id
    with commit():
        _heartbeat(ca, [(packed[0], packed[0].lease_id), (gang, lease)])
        _heartbeat(cb, [(packed[1], packed[1].lease_id), (gang, lease)])
        assert ca.post(protocol.DISCONNECT_PATH, {}).status_code == 200
    gang.refresh_from_db()
    assert (gang.status, gang.retry_count) == (JobStatus.QUEUED, 1)
    assert not GangMember.objects.filter(worker=a, holds_gpus=True).exists()
    assert _cancels(b, gang.pk)[-1]["attempt"] == lease


def test_re_registration_without_a_stopped_member_gives_its_gpus_back(worker_client, commit):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    first = gang.lease_id
    with commit():
        _report(cb, gang, protocol.FAILED, error="boom")
    body = {
        "name": a.name, "gpu_count": 2, "max_jobs": 2, "gpu_slots": [0, 1], "gpu_slots_declared": True, "multi_node": True,
        "running_jobs": [{"job_id": packed[0].pk, "attempt": packed[0].lease_id}],
    }
    with commit():
        answer = ca.post(protocol.REGISTER_PATH, body).json()
    assert [job["job_id"] for job in answer["resume_jobs"]] == [packed[0].pk]
    assert not GangMember.objects.get(lease_id=first, worker=a).holds_gpus


def test_draining_a_packing_worker_names_its_member_and_lets_it_finish(worker_client, commit, operator_client):
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = _gang(commit)
    with commit():
        assert operator_client.post(f"/api/admin/workers/{a.pk}/drain", {}).status_code == 200
    [drain] = [e["data"] for e in sent_events(a.pk) if e["type"] == protocol.DRAIN]
    assert sorted(drain["job_ids"]) == sorted([packed[0].pk, gang.pk])
    gang.refresh_from_db()
    assert gang.status == JobStatus.DISPATCHED and GangMember.objects.get(lease_id=gang.lease_id, worker=a).outcome == ""


# --- PostgreSQL: a packed dispatch and a gang race for one GPU ----------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_packed_job_and_a_gang_never_take_one_gpu_twice(postgres_url):
    """A packed dispatch holds packing worker a's row (its transaction open) while a gang that needs a's last GPU
    is dispatched: the gang skips a (SKIP LOCKED), takes no worker (none is held while it waits), and a's GPU goes
    once. When the packed job ends the gang takes the freed room."""
    import threading

    from audit.services import Actor
    from job_queue.reports import job_report
    from job_queue.tests.test_concurrency import DEADLINE_S, holder, run_concurrently

    workers = sorted((WorkerFactory(gpu_count=2, max_jobs=2, gpu_slots=[0, 1], gpus_free=2, multi_node=True) for _ in range(2)), key=lambda w: w.pk)
    for worker in workers:
        assert dispatch_for_job(JobFactory(gpu_count=1).pk).pk in {w.pk for w in workers}
    assert [Worker.objects.get(pk=w.pk).gpus_free for w in workers] == [1, 1]
    single, gang = JobFactory(gpu_count=1), JobFactory(num_nodes=2, gpu_count=1)
    holding, done = threading.Event(), threading.Event()
    a_packed_dispatch = holder(lambda: dispatch_for_job(single.pk), holding, done)

    def dispatch_the_gang():
        assert holding.wait(DEADLINE_S)
        try:
            return dispatch_for_job(gang.pk)
        finally:
            done.set()

    run_concurrently([a_packed_dispatch, dispatch_the_gang])
    single.refresh_from_db()
    gang.refresh_from_db()
    assert single.status == JobStatus.DISPATCHED and single.gpu_indices == [1]
    assert gang.status == JobStatus.QUEUED and not GangMember.objects.exists()
    for worker in workers:
        held = packing.held_jobs(worker.pk)
        indices = [i for job in held for i in job.gpu_indices]
        assert len(indices) == len(set(indices)) and Worker.objects.get(pk=worker.pk).gpus_free == 2 - len(indices)
    # The packed job ends: its GPU is given back, and the gang takes the room at once.
    job_report(worker_id=single.worker_id, job_id=single.pk, data={"status": "completed", "attempt": single.lease_id}, actor=Actor.system("agent"))
    gang.refresh_from_db()
    assert gang.status == JobStatus.DISPATCHED
    assert sorted(GangMember.objects.filter(lease_id=gang.lease_id).values_list("gpu_indices", flat=True)) == [[1], [1]]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_packed_jobs_and_gangs_dispatched_at_once_never_share_a_gpu(postgres_url):
    from job_queue.tests.test_concurrency import run_concurrently

    workers = [WorkerFactory(gpu_count=4, max_jobs=4, gpu_slots=[0, 1, 2, 3], gpus_free=4, multi_node=True) for _ in range(3)]
    jobs = [JobFactory(gpu_count=1 + n % 2) for n in range(6)] + [JobFactory(num_nodes=2, gpu_count=1 + n % 2) for n in range(4)]
    run_concurrently([lambda job=job: dispatch_for_job(job.pk) for job in jobs])
    for worker in workers:
        held = packing.held_jobs(worker.pk)
        indices = [i for job in held for i in job.gpu_indices]
        assert len(indices) == len(set(indices)) and set(indices) <= {0, 1, 2, 3}, held
        assert Worker.objects.get(pk=worker.pk).gpus_free == 4 - len(indices)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("packs", [True, False], ids=["packing", "whole-worker"])
def test_a_lost_members_worker_whose_gang_job_another_transaction_holds_waits_for_the_next_sweep(postgres_url, packs):
    """Worker b (packing, or not: a member on its whole worker), rank 1 of a gang whose rank 0 is on a, goes silent while another transaction holds the gang
    job's row (a's heartbeat, a report): the sweep cannot end the attempt now (SKIP LOCKED), so it leaves b as it is
    for its next run, as it does a worker whose own job is held. Taking b offline then would free its GPUs and leave
    the attempt running with a member on a worker nothing watches any more: never lost, never requeued."""
    import threading

    from job_queue.services import lock_job
    from job_queue.tests.test_concurrency import DEADLINE_S, holder, run_concurrently

    shape = {"gpu_count": 2, "max_jobs": 2, "gpu_slots": [0, 1], "gpus_free": 2} if packs else {"gpu_count": 1}
    a, b = sorted((WorkerFactory(multi_node=True, **shape) for _ in range(2)), key=lambda w: w.pk)
    gang = JobFactory(num_nodes=2, gpu_count=1)
    assert dispatch_for_job(gang.pk).pk == a.pk
    gang.refresh_from_db()
    lease = gang.lease_id
    Worker.objects.filter(pk=b.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    holding, done = threading.Event(), threading.Event()

    def sweep():
        assert holding.wait(DEADLINE_S)
        try:
            return sweep_stale_workers(now=timezone.now())
        finally:
            done.set()

    _, first = run_concurrently([holder(lambda: lock_job(gang.pk), holding, done), sweep])
    assert first["workers"] == 0
    assert Worker.objects.get(pk=b.pk).status == WorkerStatus.BUSY
    assert GangMember.objects.get(lease_id=lease, worker=b).holds_gpus if packs else Worker.objects.get(pk=b.pk).current_job_id == gang.pk
    # The row is free again: the next run takes b offline and ends the attempt for every member.
    second = sweep_stale_workers(now=timezone.now())
    assert (second["workers"], second["requeued"]) == (1, 1)
    gang.refresh_from_db()
    assert gang.status in (JobStatus.QUEUED, JobStatus.DISPATCHED) and gang.lease_id != lease
    assert dict(GangMember.objects.filter(lease_id=lease).values_list("rank", "outcome")) == {0: "stopped", 1: "lost"}


def test_a_stopped_members_report_after_the_gang_failed_for_good_gives_its_gpus_back(worker_client, commit):
    """b's member fails with no retry left: the job fails for good under the attempt's lease, and a's member is told
    to stop. a's agent then reports its member stopped (under that lease, still current): its GPU is given back at
    once and offered, as for a requeued gang's member, not refused as a transition of the failed job."""
    [(a, ca), (b, cb)], packed = _busy_packers(worker_client, commit)
    gang = JobFactory(num_nodes=2, gpu_count=1, max_retries=0)
    with commit():
        dispatch_for_job(gang.pk)
    gang.refresh_from_db()
    with commit():
        _heartbeat(ca, [(packed[0], packed[0].lease_id), (gang, gang.lease_id)])
        _heartbeat(cb, [(packed[1], packed[1].lease_id), (gang, gang.lease_id)])
        assert _report(cb, gang, protocol.FAILED, error="NCCL timeout").status_code == 200
    gang.refresh_from_db()
    assert gang.status == JobStatus.FAILED and _cancels(a, gang.pk)
    assert (_free(a), _free(b)) == (0, 1)
    waiting = JobFactory(gpu_count=1)  # queued for the GPU a's member gives back
    with commit():
        stopped = _report(ca, gang, protocol.CANCELLED, error="stopped")
    assert stopped.status_code == 200, stopped.json()
    gang.refresh_from_db()
    assert gang.status == JobStatus.FAILED
    assert not GangMember.objects.filter(worker=a, holds_gpus=True).exists()
    waiting.refresh_from_db()
    assert (waiting.status, waiting.worker_id) in {(JobStatus.DISPATCHED, a.pk), (JobStatus.DISPATCHED, b.pk)}
    assert _free(a) + _free(b) == 1
