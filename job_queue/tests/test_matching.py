"""labels_match and job_fits_worker: globs, exact values, missing labels, GPU counts, case."""

import pytest

from job_queue.models import Job, job_fits_worker, labels_match
from workers.models import Worker


@pytest.mark.parametrize(
    ("patterns", "labels", "expected"),
    [
        ({}, {}, True),
        (None, {"gpu_type": "a100"}, True),
        ({"gpu_type": "a100"}, {"gpu_type": "a100"}, True),
        ({"gpu_type": "a100"}, {"gpu_type": "a100-80g"}, False),
        ({"gpu_type": "a100*"}, {"gpu_type": "a100-80g"}, True),
        ({"gpu_type": "a100*"}, {"gpu_type": "a100"}, True),
        ({"gpu_type": "a100*"}, {"gpu_type": "h100"}, False),
        ({"gpu_type": "*100"}, {"gpu_type": "h100"}, True),
        ({"gpu_type": "a?00"}, {"gpu_type": "a600"}, True),
        ({"gpu_type": "[ah]100"}, {"gpu_type": "h100"}, True),
        ({"gpu_type": "*"}, {"gpu_type": ""}, True),
        ({"gpu_type": "*"}, {}, False),
        ({"team": "nlp"}, {"gpu_type": "a100"}, False),
        ({"team": "nlp"}, None, False),
        ({"team": "nlp", "gpu_type": "a100*"}, {"team": "nlp", "gpu_type": "a100"}, True),
        ({"team": "nlp", "gpu_type": "a100*"}, {"team": "cv", "gpu_type": "a100"}, False),
        ({"gpu_type": "A100"}, {"gpu_type": "a100"}, False),
        ({"gpu_type": "a100*"}, {"gpu_type": "A100-80G"}, False),
        ({"Team": "nlp"}, {"team": "nlp"}, False),
    ],
)
def test_labels_match(patterns, labels, expected):
    assert labels_match(patterns, labels) is expected


@pytest.mark.parametrize(
    ("needed", "has", "expected"),
    [(0, 0, True), (0, 8, True), (1, 1, True), (2, 8, True), (8, 2, False), (1, 0, False)],
)
def test_job_fits_worker_by_gpu_count(needed, has, expected):
    assert job_fits_worker(Job(gpu_count=needed), Worker(gpu_count=has)) is expected


def test_job_fits_worker_needs_both_gpus_and_labels():
    job = Job(gpu_count=2, worker_labels={"gpu_type": "a100*"})

    assert job_fits_worker(job, Worker(gpu_count=2, labels={"gpu_type": "a100-80g"}))
    assert not job_fits_worker(job, Worker(gpu_count=1, labels={"gpu_type": "a100-80g"}))
    assert not job_fits_worker(job, Worker(gpu_count=4, labels={"gpu_type": "h100"}))
