"""The artifact store through its endpoints: uploads fenced by the attempt's token, downloads, checkpoints."""

import hashlib

import pytest
from rest_framework.test import APIClient

from artifacts.models import Artifact, AttemptSteps, Checkpoint
from artifacts.tests.support import downloaded
from artifacts.tokens import upload_token
from audit import actions
from job_queue.dispatch import dispatch_for_job
from job_queue.models import Job, JobStatus
from audit.services import Actor
from job_queue.agents import worker_disconnect
from job_queue.tests.factories import job_on_worker
from worker_agent import protocol
from workers.tests.factories import UserFactory, WorkerFactory
from workers.tests.support import admin_url, audit_rows, sent_events

pytestmark = pytest.mark.django_db


def uploader(token):
    client = APIClient()
    client.credentials(HTTP_X_UPLOAD_TOKEN=token)
    return client


def put(token, path, data, **extra):
    return uploader(token).put(f"{protocol.UPLOAD_PATH}/{path}", data, content_type="application/octet-stream", **extra)


def running_job():
    worker = WorkerFactory()
    job = job_on_worker(worker)
    return job, worker, upload_token(job.lease_id)


def release(job):
    """The attempt is lost (its worker went away): the job goes back to the queue."""
    worker_disconnect(worker_id=job.worker_id, actor=Actor.system("test"), reason="lost")
    assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED


def test_an_upload_is_stored_in_the_jobs_namespace_with_its_sha256(artifact_storage_dir):
    job, _, token = running_job()
    body = b"weights" * 1000

    response = put(token, "my-bucket/run/model.safetensors", body)

    assert response.status_code == 201, response.content
    digest = hashlib.sha256(body).hexdigest()
    assert response.json()["sha256"] == digest and response.json()["size"] == len(body)
    assert response.json()["Key"] == "run/model.safetensors" and response.json()["Bucket"] == "my-bucket"
    assert response["ETag"] == f'"{digest}"'
    artifact = Artifact.objects.get(job_id=job.pk)
    assert (artifact.key, artifact.size, artifact.sha256, artifact.attempt_number) == (
        "my-bucket/run/model.safetensors", len(body), digest, 1,
    )
    assert artifact.storage_name.startswith(f"outputs/{job.pk}/")
    assert (artifact_storage_dir / artifact.storage_name).read_bytes() == body
    (row,) = audit_rows(actions.ARTIFACT_STORED)
    assert row.target_id == job.pk and row.details["sha256"] == digest


def test_the_upstream_header_is_accepted_too():
    job, _, token = running_job()
    response = APIClient().put(
        f"{protocol.UPLOAD_PATH}/b/k.bin", b"x", content_type="application/octet-stream", HTTP_X_SIMPLETUNER_SECRET=token
    )
    assert response.status_code == 201


def test_a_second_upload_of_the_key_replaces_the_file_and_removes_the_old_one(artifact_storage_dir, commit):
    job, _, token = running_job()
    with commit():
        assert put(token, "b/model.bin", b"first").status_code == 201
    old = Artifact.objects.get(job_id=job.pk).storage_name

    with commit():
        response = put(token, "b/model.bin", b"second")

    assert response.status_code == 200
    artifact = Artifact.objects.get(job_id=job.pk)
    assert artifact.sha256 == hashlib.sha256(b"second").hexdigest()
    assert (artifact_storage_dir / artifact.storage_name).read_bytes() == b"second"
    assert not (artifact_storage_dir / old).exists()


@pytest.mark.parametrize(
    "path",
    ["b/../../etc/passwd", "b/a/../x", "b/./x", "b//x", "../b/x", "b/x\x00y", "b/x\\y", "b/" + "k" * 1100],
)
def test_a_bad_key_is_a_400_and_nothing_is_stored(path, artifact_storage_dir):
    _, _, token = running_job()
    response = put(token, path, b"data")
    assert response.status_code in (400, 404), response.content  # 404: Django's router refuses a NUL itself
    if response.status_code == 400:
        assert response.json()["code"] in (protocol.INVALID_KEY, "bad_request")
    assert not Artifact.objects.exists()
    assert not any(p.is_file() for p in artifact_storage_dir.rglob("*"))


@pytest.mark.parametrize("segment", ["k" * 256, "é" * 200])
def test_a_key_segment_over_255_bytes_is_a_400_naming_the_limit_and_nothing_is_stored(segment, artifact_storage_dir):
    _, _, token = running_job()
    response = put(token, f"outputs/{segment}/model.bin", b"data")
    assert response.status_code == 400, response.content
    assert response.json()["code"] == protocol.INVALID_KEY and "at most 255 bytes" in response.json()["detail"]
    assert not Artifact.objects.exists()
    assert not any(p.is_file() for p in artifact_storage_dir.rglob("*"))


def test_dot_dot_is_refused_with_its_reason():
    _, _, token = running_job()
    response = put(token, "b/a/../x", b"data")
    assert response.status_code == 400
    assert response.json()["code"] == protocol.INVALID_KEY and "'..'" in response.json()["detail"]


def test_an_unknown_token_is_a_401():
    running_job()
    for token in ("", "stu_a_0000:forged", "nonsense"):
        response = put(token, "b/x", b"data")
        assert response.status_code == 401, token
        assert response.json()["code"] == protocol.NOT_AUTHENTICATED
    assert not Artifact.objects.exists()


def test_unknown_upload_tokens_count_as_failed_authentications(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"failed_auth": "2/min"}}
    _, _, token = running_job()
    answers = [put("stu_guess:" + str(n), "b/x", b"data").status_code for n in range(3)]
    assert answers == [401, 401, 429]
    assert put(token, "b/x", b"data").status_code == 201  # a live attempt's token is not a failure
    (row,) = audit_rows(actions.AUTH_FAILED)  # the first refusal of the window, and the one past the rate
    assert (row.details["kind"], row.details["token_prefix"], row.success) == ("upload", "stu_guess?", False)  # the display prefix: never the whole token
    assert [r.details["kind"] for r in audit_rows(actions.AUTH_THROTTLED)] == ["upload"]


def test_the_token_of_an_attempt_that_lost_the_job_is_a_409_and_the_next_attempt_has_its_own(commit):
    job, _, old_token = running_job()
    release(job)
    assert put(old_token, "b/x", b"data").status_code == 409
    worker = WorkerFactory()
    with commit():
        dispatch_for_job(job.pk)
    (event,) = sent_events(worker.pk)
    new_token = event["data"]["upload_token"]

    refused = put(old_token, "b/x", b"data")
    accepted = put(new_token, "b/x", b"data")

    assert new_token != old_token
    assert refused.status_code == 409 and refused.json()["code"] == protocol.STALE_ATTEMPT
    assert accepted.status_code == 201 and accepted.json()["attempt"] == 2


def test_the_token_of_a_finished_job_is_a_409():
    job, _, token = running_job()
    Job.objects.filter(pk=job.pk).update(status=JobStatus.COMPLETED)
    assert put(token, "b/x", b"data").status_code == 409


def test_over_the_size_limit_or_the_quota_is_a_413(settings, artifact_storage_dir, commit):
    job, _, token = running_job()
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "ARTIFACT_MAX_BYTES": 10, "ARTIFACT_JOB_QUOTA_BYTES": 15}

    too_big = put(token, "b/big", b"x" * 11)
    first = put(token, "b/one", b"x" * 10)
    over_quota = put(token, "b/two", b"x" * 6)
    with commit():
        replacing = put(token, "b/one", b"y" * 10)  # a replaced file's bytes are free again

    assert too_big.status_code == 413 and too_big.json()["code"] == protocol.UPLOAD_TOO_LARGE
    assert first.status_code == 201
    assert over_quota.status_code == 413 and over_quota.json()["code"] == protocol.QUOTA_EXCEEDED
    assert replacing.status_code == 200
    assert sorted(Artifact.objects.values_list("key", flat=True)) == ["b/one"]
    assert len([p for p in artifact_storage_dir.rglob("*") if p.is_file()]) == 1


def test_a_body_longer_than_it_said_is_cut_off_at_the_limit(settings, artifact_storage_dir):
    """The limit holds while streaming, whatever Content-Length claimed."""
    from artifacts.storage import UploadTooLarge, file_receive
    import io

    with pytest.raises(UploadTooLarge):
        file_receive(job_id="j_x", key="b/k", stream=io.BytesIO(b"z" * 5000), limit=4096)
    assert not any(p.is_file() for p in artifact_storage_dir.rglob("*"))


def test_the_reader_gives_whole_reads_and_a_short_body_is_refused(artifact_storage_dir):
    import io

    from artifacts.storage import HashingReader, IncompleteUpload, file_receive

    class Trickle(io.RawIOBase):
        """A request stream that returns at most 1000 bytes a read."""

        def __init__(self, data):
            self.data = data

        def read(self, size=-1):
            piece, self.data = self.data[: min(size, 1000)], self.data[min(size, 1000) :]
            return piece

    reader = HashingReader(Trickle(b"x" * 5000), limit=10_000)
    assert [len(reader.read(3000)), len(reader.read(3000)), len(reader.read(3000))] == [3000, 2000, 0]
    with pytest.raises(IncompleteUpload):
        file_receive(job_id="j_x", key="b/k", stream=io.BytesIO(b"z" * 10), limit=100, expected_size=11)
    assert not any(p.is_file() for p in artifact_storage_dir.rglob("*"))


# --- checkpoints and resume ---------------------------------------------------------------------


def heartbeat(worker_client, worker, job, **extra):
    return worker_client(worker).post(
        protocol.HEARTBEAT_PATH,
        {"worker_id": worker.pk, "status": "busy", "current_job_id": job.pk, "attempt": job.lease_id, **extra},
    )


def test_a_checkpoint_is_complete_once_its_attempt_speaks_after_it(worker_client):
    job, worker, token = running_job()
    put(token, "out/checkpoint-10/model.bin", b"ten")
    put(token, "out/checkpoint-10/optimizer.bin", b"opt")
    assert Checkpoint.objects.get(job_id=job.pk, step=10).completed_at is None

    assert heartbeat(worker_client, worker, job, progress={"step": 12}).status_code == 200

    assert Checkpoint.objects.get(job_id=job.pk, step=10).completed_at is not None
    assert AttemptSteps.objects.get(lease_id=job.lease_id).reached_step == 12
    assert [r.details["step"] for r in audit_rows(actions.CHECKPOINT_COMPLETED)] == [10]


def test_an_attempt_may_declare_its_checkpoint_complete():
    job, _, token = running_job()
    put(token, "out/checkpoint-20/model.bin", b"twenty")

    missing = uploader(token).post(protocol.checkpoint_complete_path(30))
    declared = uploader(token).post(protocol.checkpoint_complete_path(20))

    assert missing.status_code == 404
    assert declared.status_code == 200
    assert Checkpoint.objects.get(job_id=job.pk, step=20).completed_at is not None


def test_a_checkpoint_uploaded_as_declared_waits_for_its_declaration_whoever_speaks(worker_client):
    """Our agent uploads a trainer's finished checkpoint file by file while it heartbeats: a heartbeat between
    two files must not complete it, or a resume could get half of it."""
    job, worker, token = running_job()
    declares = {"HTTP_" + protocol.CHECKPOINT_DECLARES_HEADER.upper().replace("-", "_"): "1"}
    assert put(token, "output/checkpoint-4/pytorch_lora_weights.safetensors", b"four", **declares).status_code == 201

    assert heartbeat(worker_client, worker, job, progress={"step": 5}).status_code == 200
    assert Checkpoint.objects.get(job_id=job.pk, step=4).completed_at is None
    assert audit_rows(actions.CHECKPOINT_COMPLETED) == []

    put(token, "output/checkpoint-4/.guard", b"complete\n", **declares)
    assert uploader(token).post(protocol.checkpoint_complete_path(4)).status_code == 200
    checkpoint = Checkpoint.objects.get(job_id=job.pk, step=4)
    assert checkpoint.completed_at is not None and checkpoint.declared
    assert [r.details for r in audit_rows(actions.CHECKPOINT_COMPLETED)] == [{"step": 4, "attempt": job.lease_id, "declared": True}]


def test_a_requeued_job_resumes_from_its_latest_complete_checkpoint(worker_client, commit):
    job, worker, token = running_job()
    put(token, "out/checkpoint-10/model.bin", b"ten")
    heartbeat(worker_client, worker, job)
    put(token, "out/checkpoint-20/model.bin", b"twenty")
    uploader(token).post(protocol.checkpoint_complete_path(20))
    put(token, "out/checkpoint-30/model.bin", b"thirty, never completed")
    release(job)
    second = WorkerFactory()

    with commit():
        dispatch_for_job(job.pk)

    (event,) = sent_events(second.pk)
    resume = event["data"]["resume"]
    assert (resume["step"], resume["checkpoint"], resume["attempt"]) == (20, "checkpoint-20", 1)
    (item,) = resume["files"]
    assert item["key"] == "out/checkpoint-20/model.bin" and item["sha256"] == hashlib.sha256(b"twenty").hexdigest()
    new_token = event["data"]["upload_token"]
    download = uploader(new_token).get(item["download_url"])
    assert download.status_code == 200 and downloaded(download) == b"twenty"
    assert download["X-Checksum-SHA256"] == item["sha256"]
    assert uploader(token).get(item["download_url"]).status_code == 409  # the lost attempt's token is dead
    job.refresh_from_db()
    assert AttemptSteps.objects.get(lease_id=job.lease_id).start_step == 20


def test_a_job_without_a_complete_checkpoint_starts_from_scratch(commit):
    job, _, token = running_job()
    put(token, "out/checkpoint-10/model.bin", b"ten")  # nobody spoke after it
    release(job)
    second = WorkerFactory()
    with commit():
        dispatch_for_job(job.pk)
    (event,) = sent_events(second.pk)
    assert event["data"]["resume"] is None


# --- the operator's side -------------------------------------------------------------------------


def test_the_job_detail_lists_artifacts_and_steps_and_download_checks_the_permission(bearer_client, worker_client):
    job, worker, token = running_job()
    put(token, "out/final/model.bin", b"final weights")
    heartbeat(worker_client, worker, job, progress={"step": 7})
    viewer = bearer_client(UserFactory(permissions=["queue.view_job"]))

    detail = viewer.get(f"/api/queue/{job.pk}")

    assert detail.status_code == 200
    (artifact,) = detail.json()["artifacts"]
    assert artifact["key"] == "out/final/model.bin" and artifact["attempt"] == 1
    assert artifact["sha256"] == hashlib.sha256(b"final weights").hexdigest() and artifact["size"] == 13
    (attempt,) = detail.json()["attempts"]
    assert (attempt["start_step"], attempt["reached_step"]) == (0, 7)
    assert viewer.get(artifact["download_url"]).status_code == 403
    downloader = bearer_client(UserFactory(permissions=["artifacts.download_artifact"]))
    response = downloader.get(artifact["download_url"])
    assert response.status_code == 200 and downloaded(response) == b"final weights"


def test_the_job_admin_page_shows_the_artifacts(staff_client):
    job, _, token = running_job()
    put(token, "out/final/model.bin", b"final weights")
    response = staff_client("queue.view_job").get(admin_url(job))
    assert response.status_code == 200
    assert b"out/final/model.bin" in response.content
    assert hashlib.sha256(b"final weights").hexdigest().encode() in response.content


def test_the_shipped_operator_group_may_download(queue_client):
    job, _, token = running_job()
    put(token, "out/final/model.bin", b"w")
    artifact = Artifact.objects.get()
    assert queue_client.get(f"/api/artifacts/{artifact.pk}/download").status_code == 200


@pytest.mark.django_db(transaction=True)
def test_an_upload_gives_its_database_connection_back_while_the_body_goes_to_storage(monkeypatch, artifact_storage_dir):
    """A body may take minutes to reach S3: the connection is not held meanwhile (back in the pool on PostgreSQL),
    and the artifact is still recorded, fenced, once it is stored."""
    from django.db import connection

    import job_queue.uploads

    job, _, token = running_job()
    closed, held = [], []
    close, receive = connection.close, job_queue.uploads.file_receive

    def counted_close():
        closed.append(True)
        close()

    def watched(**kwargs):
        held.append((len(closed), connection.connection is not None))
        return receive(**kwargs)

    monkeypatch.setattr(connection, "close", counted_close)
    monkeypatch.setattr(job_queue.uploads, "file_receive", watched)

    response = put(token, "b/model.bin", b"weights")

    assert response.status_code == 201, response.content
    ((closes, open_meanwhile),) = held
    assert closes == 1
    # Django keeps a test run's in-memory SQLite database open whatever it is told; any other database closes
    assert open_meanwhile == (connection.vendor == "sqlite" and connection.is_in_memory_db())
    assert Artifact.objects.get(job_id=job.pk).size == len(b"weights")


def test_a_download_streams_chunk_by_chunk_with_a_file_responses_headers(artifact_storage_dir, commit, settings, monkeypatch):
    """Under ASGI Django reads a sync iterator whole before sending a byte: a download is an async iterator of
    the storage's chunks instead, with the headers a file response gives (type, disposition, size, checksum)."""
    import threading

    from asgiref.sync import async_to_sync, sync_to_async

    import artifacts.api.views

    monkeypatch.setattr(artifacts.api.views, "CHUNK_BYTES", 4)
    job, _, token = running_job()
    with commit():
        assert put(token, "b/out/model.safetensors", b"0123456789").status_code == 201

    response = uploader(token).get(f"{protocol.UPLOAD_PATH}/b/out/model.safetensors")

    assert response.status_code == 200
    chunks, readers = [], set()

    def reading_on(read, **kwargs):  # the view's own sync_to_async, noting the thread each read runs on
        def noted(*args):
            readers.add(threading.current_thread().name.rsplit("_", 1)[0])
            return read(*args)

        return sync_to_async(noted, **kwargs)

    monkeypatch.setattr(artifacts.api.views, "sync_to_async", reading_on)

    async def read():
        async for chunk in response.streaming_content:
            chunks.append(chunk)

    async_to_sync(read)()
    assert chunks == [b"0123", b"4567", b"89"]
    assert readers == {"transfer-read"}  # the download threads, never the loop's default executor (the streams')
    assert response["Content-Length"] == "10" and response["Content-Type"] == "application/octet-stream"
    assert response["Content-Disposition"] == 'attachment; filename="b_out_model.safetensors"'
