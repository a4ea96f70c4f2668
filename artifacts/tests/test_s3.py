"""The artifact store on S3-compatible storage: a real S3 server (moto's server mode, started here) behind
django-storages, through the same endpoints as the filesystem store."""

import hashlib

import boto3
import pytest
from moto.server import ThreadedMotoServer

from artifacts.models import Artifact
from artifacts.sweeps import sweep_expired_artifacts
from artifacts.tests.support import downloaded
from artifacts.tests.test_uploads import put, release, running_job, uploader
from job_queue.dispatch import dispatch_for_job
from simpletuner_site import settings as site_settings
from worker_agent import protocol
from workers.tests.factories import UserFactory, WorkerFactory
from workers.tests.support import sent_events

pytestmark = pytest.mark.django_db

BUCKET = "st-artifacts"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server, settings, monkeypatch):
    """The artifact storage is a fresh bucket on the S3 server, configured as SIMPLETUNER_ARTIFACT_S3_* would."""
    client = boto3.client("s3", endpoint_url=s3_server, **CREDENTIALS)
    client.create_bucket(Bucket=BUCKET)
    monkeypatch.setenv("SIMPLETUNER_ARTIFACT_S3_BUCKET", BUCKET)
    monkeypatch.setenv("SIMPLETUNER_ARTIFACT_S3_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("SIMPLETUNER_ARTIFACT_S3_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    settings.STORAGES = {**settings.STORAGES, "artifacts": site_settings._artifact_storage()}
    assert settings.STORAGES["artifacts"]["BACKEND"] == "storages.backends.s3.S3Storage"
    yield client
    for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=item["Key"])
    client.delete_bucket(Bucket=BUCKET)


def objects(client):
    return {item["Key"]: item["Size"] for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])}


def test_an_upload_lands_in_the_bucket_under_the_jobs_namespace(s3):
    job, _, token = running_job()
    body = b"s3 weights " * 100_000  # 1.1 MB: more than one chunk

    response = put(token, "any-bucket/run/model.safetensors", body)

    assert response.status_code == 201
    assert response.json()["sha256"] == hashlib.sha256(body).hexdigest()
    artifact = Artifact.objects.get(job_id=job.pk)
    assert objects(s3) == {artifact.storage_name: len(body)}
    assert artifact.storage_name.startswith(f"outputs/{job.pk}/") and artifact.storage_name.endswith("/any-bucket/run/model.safetensors")
    stored = s3.get_object(Bucket=BUCKET, Key=artifact.storage_name)["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == artifact.sha256


def test_a_multipart_upload_is_stored_whole(s3):
    """Past boto3's multipart threshold (8 MiB) the body is read in parts of exactly the size asked for: a
    reader returning less would end the object early (this stored 2 MiB of 256 before the fix)."""
    job, _, token = running_job()
    body = bytes(range(256)) * (20 * 4096)  # 20 MiB

    response = put(token, "b/big.bin", body)

    assert response.status_code == 201 and response.json()["size"] == len(body)
    artifact = Artifact.objects.get(job_id=job.pk)
    assert objects(s3) == {artifact.storage_name: len(body)}
    stored = s3.get_object(Bucket=BUCKET, Key=artifact.storage_name)["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == artifact.sha256 == hashlib.sha256(body).hexdigest()


def test_replace_download_and_refusals_on_s3(s3, bearer_client, commit, settings):
    job, _, token = running_job()
    with commit():
        put(token, "b/model.bin", b"first")
        assert put(token, "b/model.bin", b"second").status_code == 200
    artifact = Artifact.objects.get(job_id=job.pk)
    assert list(objects(s3)) == [artifact.storage_name]  # the replaced object is gone

    downloader = bearer_client(UserFactory(permissions=["artifacts.download_artifact"]))
    response = downloader.get(f"/api/artifacts/{artifact.pk}/download")
    assert response.status_code == 200 and downloaded(response) == b"second"
    assert response["X-Checksum-SHA256"] == hashlib.sha256(b"second").hexdigest()

    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "ARTIFACT_MAX_BYTES": 3}
    assert put(token, "b/big.bin", b"four").status_code == 413
    assert put(token, "b/../x", b"x").status_code == 400
    assert put("stu_unknown:x", "b/x", b"x").status_code == 401
    assert list(objects(s3)) == [artifact.storage_name]  # nothing of the refused uploads was kept


def test_resume_from_s3_and_a_dead_token_on_s3(s3, commit):
    job, _, token = running_job()
    put(token, "out/checkpoint-4/model.bin", b"four")
    uploader(token).post(protocol.checkpoint_complete_path(4))
    release(job)
    second = WorkerFactory()
    with commit():
        dispatch_for_job(job.pk)
    (event,) = sent_events(second.pk)
    (item,) = event["data"]["resume"]["files"]

    fresh = uploader(event["data"]["upload_token"]).get(item["download_url"])
    stale = uploader(token).get(item["download_url"])

    assert fresh.status_code == 200 and downloaded(fresh) == b"four"
    assert stale.status_code == 409


def test_the_retention_sweep_deletes_objects(s3, settings, commit):
    from datetime import timedelta

    from django.utils import timezone

    job, _, token = running_job()
    put(token, "b/old.bin", b"old")
    Artifact.objects.update(updated_at=timezone.now() - timedelta(days=10))
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "ARTIFACT_RETENTION_DAYS": 7}
    with commit():
        assert sweep_expired_artifacts() == 1
    assert objects(s3) == {}
