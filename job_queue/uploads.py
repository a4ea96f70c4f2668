"""The artifact store's door for attempts: uploads, checkpoint declarations and resume downloads, each
fenced by the attempt's upload token like a status report (valid only while that attempt holds the job)."""

from django.db import connection

from artifacts import keys, services as artifact_services, tokens
from artifacts.models import Artifact
from artifacts.storage import IncompleteUpload, UploadTooLarge, file_delete, file_receive
from audit.models import ActorType
from audit.services import Actor, audited_atomic
from common.errors import InvalidInput, NotAuthenticated, NotFound, StaleReport, TooLarge
from worker_agent import protocol

from .models import JOB_ACTIVE, JobAttempt
from .services import lock_job


def attempt_for_token(token):
    """Return the JobAttempt (with its job) that ``token`` was issued to; raise NotAuthenticated (401) if none."""
    lease = tokens.token_lease(token)
    attempt = JobAttempt.objects.select_related("job").filter(lease_id=lease).first() if lease else None
    if attempt is None:
        raise NotAuthenticated(f"an upload needs this attempt's upload token in {protocol.UPLOAD_TOKEN_HEADER}")
    return attempt


def _check_holds(job, lease_id):
    """Raise StaleReport (409 ``stale_attempt``) unless attempt ``lease_id`` still holds ``job``."""
    if job.lease_id != lease_id or job.status not in JOB_ACTIVE:
        raise StaleReport(
            f"attempt {lease_id} no longer holds job {job.pk}: its upload token is dead", code=protocol.STALE_ATTEMPT
        )


def _fenced_key(token, bucket, key):
    """Return ``(attempt, bucket/key)`` for a request of the attempt holding ``token``; raise NotAuthenticated,
    StaleReport or InvalidInput (``invalid_key``)."""
    attempt = attempt_for_token(token)
    _check_holds(attempt.job, attempt.lease_id)
    try:
        return attempt, keys.clean_key(bucket, key)
    except keys.BadKey as exc:
        raise InvalidInput(str(exc), code=protocol.INVALID_KEY) from None


def upload_actor(attempt, ip=None):
    """The audit actor of what an attempt's token does: the worker that runs the attempt."""
    return Actor(ActorType.WORKER, attempt.worker_id or "", attempt.worker_name, ip)


def attempt_upload(*, token, bucket, key, stream, declared_length, declares=False, ip=None):
    """Store the body ``stream`` as ``bucket/key`` in the namespace of the job ``token``'s attempt holds;
    return ``(artifact, created)``. ``declares``: the file belongs to a checkpoint the attempt declares
    complete itself (``protocol.CHECKPOINT_DECLARES_HEADER``).

    Raise NotAuthenticated (401), StaleReport (409: the attempt no longer holds the job, before or
    after the body arrived; nothing is kept then), InvalidInput (400 ``invalid_key``, or
    ``incomplete_upload`` for a body shorter than its Content-Length) or TooLarge (413).
    """
    attempt, full_key = _fenced_key(token, bucket, key)
    job_id = attempt.job_id
    limit = artifact_services.upload_limit(job_id=job_id, key=full_key, declared=declared_length)
    if not connection.in_atomic_block:
        # The body may take minutes to reach storage (S3): meanwhile its database connection goes back to the
        # pool (PostgreSQL) rather than idling in the transfer; the record below takes one again.
        connection.close()
    try:
        stored = file_receive(job_id=job_id, key=full_key, stream=stream, limit=limit, expected_size=declared_length)
    except IncompleteUpload as exc:
        raise InvalidInput(f"nothing stored: {exc}", code="incomplete_upload") from None
    except UploadTooLarge as exc:
        raise TooLarge(
            f"the upload passed its limit of {exc.limit} bytes (the artifact size limit or the job's quota)",
            code=protocol.UPLOAD_TOO_LARGE,
        ) from None
    try:
        with audited_atomic():
            job = lock_job(job_id)
            _check_holds(job, attempt.lease_id)
            result = artifact_services.artifact_record(
                job_id=job_id,
                lease_id=attempt.lease_id,
                attempt_number=attempt.number,
                key=full_key,
                stored=stored,
                declares=declares,
                actor=upload_actor(attempt, ip),
            )
    except BaseException:
        file_delete(stored.name)
        raise
    return result


def attempt_download(*, token, bucket, key):
    """Return the Artifact ``bucket/key`` of the job whose live attempt holds ``token`` (a resuming attempt
    reads the checkpoint an earlier one wrote). Raise NotAuthenticated, StaleReport, InvalidInput or NotFound."""
    attempt, full_key = _fenced_key(token, bucket, key)
    artifact = Artifact.objects.filter(job_id=attempt.job_id, key=full_key).first()
    if artifact is None:
        raise NotFound(f"job {attempt.job_id} has no artifact {full_key}")
    return artifact


def attempt_declare_checkpoint(*, token, step, ip=None):
    """The attempt holding ``token`` declares its checkpoint of ``step`` complete. Raise NotAuthenticated,
    StaleReport or NotFound (it uploaded no file of it)."""
    attempt = attempt_for_token(token)
    with audited_atomic():
        job = lock_job(attempt.job_id)
        _check_holds(job, attempt.lease_id)
        artifact_services.checkpoint_declare_complete(
            job_id=job.pk, lease_id=attempt.lease_id, step=step, actor=upload_actor(attempt, ip)
        )
