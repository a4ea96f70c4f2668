"""factory_boy factories for jobs and attempts, and a helper that puts a job on a worker."""

import factory
from django.utils import timezone
from factory.django import DjangoModelFactory

from job_queue.fairshare import share_ensure
from job_queue.models import Job, JobAttempt, JobStatus, JobTarget, new_lease_id
from workers.models import Worker, WorkerStatus


class JobFactory(DjangoModelFactory):
    """A queued job for any remote worker. Pass ``submitted_at=`` to pin its place in the FIFO."""

    class Meta:
        model = Job

    config_name = factory.Sequence(lambda n: f"config-{n}")
    config = factory.LazyFunction(lambda: {"model_type": "lora", "model_family": "flux"})
    dataloader = factory.LazyFunction(lambda: [{"id": "pics", "type": "local", "instance_data_dir": "/data/pics"}])
    target = JobTarget.WORKER
    status = JobStatus.QUEUED
    max_retries = 3

    @classmethod
    def _create(cls, model_class, *args, **kwargs):
        submitted_at = kwargs.pop("submitted_at", None)
        job = super()._create(model_class, *args, **kwargs)
        if submitted_at is not None:  # auto_now_add ignores a value given at creation
            model_class.objects.filter(pk=job.pk).update(submitted_at=submitted_at)
            job.submitted_at = submitted_at
        if job.status == JobStatus.QUEUED:  # as a job queued by the dispatcher: its share has its row
            share_ensure(job)
        return job


class JobAttemptFactory(DjangoModelFactory):
    class Meta:
        model = JobAttempt

    job = factory.SubFactory(JobFactory)
    number = 1
    lease_id = factory.LazyFunction(new_lease_id)
    worker_name = factory.LazyAttribute(lambda a: a.worker.name if a.worker else "")
    dispatched_at = factory.LazyFunction(timezone.now)


def job_on_worker(worker, *, status=JobStatus.RUNNING, **job_fields):
    """Return a job in ``status`` (dispatched or running) held by ``worker``, with its attempt.

    The worker becomes busy with it (or stays draining). Built directly, not through dispatch, so
    tests of reports, cancellation and loss do not depend on the dispatcher.
    """
    now = timezone.now()
    lease = new_lease_id()
    attempt_number = job_fields.pop("attempt_count", 1)
    job = JobFactory(
        status=status,
        worker=worker,
        worker_name=worker.name,
        lease_id=lease,
        attempt_count=attempt_number,
        dispatched_at=now,
        started_at=now if status == JobStatus.RUNNING else None,
        **job_fields,
    )
    JobAttemptFactory(
        job=job,
        number=attempt_number,
        lease_id=lease,
        worker=worker,
        dispatched_at=now,
        started_at=job.started_at,
    )
    worker_status = WorkerStatus.DRAINING if worker.drain_requested_at else WorkerStatus.BUSY
    Worker.objects.filter(pk=worker.pk).update(status=worker_status, current_job=job)
    worker.refresh_from_db()
    return job
