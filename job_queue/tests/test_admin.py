"""The Jobs admin pages through the test client: submit, the live list, the detail page, cancel, retry."""

import json

import pytest

from audit import actions
from audit.tests.factories import AuditEventFactory
from job_queue.models import AttemptOutcome, Job, JobStatus
from job_queue.tests.factories import JobAttemptFactory, JobFactory, job_on_worker
from workers.tests.factories import WorkerFactory
from workers.tests.support import (
    action_names,
    admin_messages,
    admin_url,
    audit_rows,
    changelist_rows,
    listed,
    post_action,
    sent_events,
)

pytestmark = pytest.mark.django_db

LIST = "/admin/queue/job/"
ADD = LIST + "add/"
LIVE = LIST + "live/"


def submission(**fields):
    """Return the submit form's POST data for a valid job, with ``fields`` replaced."""
    return {
        "config_name": "flux-lora",
        "config": json.dumps({"model_type": "lora", "num_processes": 2}),
        "dataloader": json.dumps([{"id": "pics"}]),
        "target": "worker",
        "worker_labels": "",
        "gpu_count": "",
        "priority": "0",
        "max_retries": "",
        **fields,
    }


# --- submit ---------------------------------------------------------------------------------------


def test_the_submit_page_shows_the_form(admin_client):
    response = admin_client.get(ADD)

    assert response.status_code == 200
    assert 'id="job_submit_form"' in response.content.decode()
    assert response.context["form"]["max_retries"].value() == 3


def test_submitting_dispatches_to_an_idle_worker_with_an_open_stream(admin_client, admin_user, commit):
    worker = WorkerFactory(name="gpu-box-1", gpu_count=2, labels={"gpu_type": "a100-80", "zone": "eu"})

    with commit():
        response = admin_client.post(
            ADD,
            submission(worker_labels="gpu_type=a100*\n\nzone = eu\n", priority="3", max_retries="1", retry_on_failure="on"),
        )

    job = Job.objects.get()
    assert (response.status_code, response["Location"]) == (302, admin_url(job))
    assert admin_messages(response) == [f"Submitted {job.pk}: dispatched to gpu-box-1."]
    assert (job.status, job.worker_id) == (JobStatus.DISPATCHED, worker.pk)
    assert (job.config, job.dataloader) == ({"model_type": "lora", "num_processes": 2}, [{"id": "pics"}])
    assert job.worker_labels == {"gpu_type": "a100*", "zone": "eu"}
    assert (job.gpu_count, job.priority, job.max_retries, job.retry_on_failure) == (2, 3, 1, True)
    assert job.submitted_by == admin_user
    (row,) = audit_rows(actions.JOB_SUBMITTED, target_id=job.pk)
    assert (row.actor_type, row.actor_name) == ("user", "admin")
    assert [(e["type"], e["data"]["job_id"]) for e in sent_events(worker.pk)] == [("job_submit", job.pk)]


@pytest.mark.parametrize(
    ("worker_fields", "reason"),
    [
        (None, "no worker is registered"),
        ({"stream_id": None}, "1 worker matches but none is available (1 idle without an open stream)"),
        ({"status": "busy"}, "1 worker matches but none is available (1 busy)"),
        ({"gpu_count": 1}, "no worker has >= 2 GPUs (the most any has is 1)"),
    ],
)
def test_submitting_without_an_available_worker_queues_and_says_why(admin_client, commit, worker_fields, reason):
    if worker_fields is not None:
        WorkerFactory(**{"gpu_count": 2, **worker_fields})

    with commit():
        response = admin_client.post(ADD, submission())

    job = Job.objects.get()
    assert job.status == JobStatus.QUEUED and job.worker_id is None
    assert response["Location"] == admin_url(job)
    assert admin_messages(response) == [f"Submitted {job.pk}: queued; {reason}."]
    assert sent_events() == []


@pytest.mark.parametrize("config", ["{}", ""])
def test_the_defaults_are_the_apis(admin_client, config):
    # The form opens with config {}; submitting it as it is must work.
    admin_client.post(ADD, submission(config=config, dataloader=""))

    job = Job.objects.get()
    assert (job.config, job.dataloader, job.worker_labels) == ({}, None, {})
    assert (job.gpu_count, job.max_retries, job.retry_on_failure) == (0, 3, False)


@pytest.mark.parametrize(
    ("fields", "field", "error"),
    [
        ({"config": "[1, 2]"}, "config", "config must be a JSON object ({...})"),
        ({"config": '"lora"'}, "config", "config must be a JSON object ({...})"),
        ({"config": "{not json"}, "config", "Enter a valid JSON."),
        ({"dataloader": "{oops"}, "dataloader", "Enter a valid JSON."),
        ({"dataloader": '"pics"'}, "dataloader", "dataloader must be an object or a list"),
        ({"gpu_count": "-1"}, "gpu_count", "Ensure this value is greater than or equal to 0."),
        ({"gpu_count": "2000"}, "gpu_count", "Ensure this value is less than or equal to 1024."),
        ({"priority": "5000"}, "priority", "Ensure this value is less than or equal to 1000."),
        ({"max_retries": "-1"}, "max_retries", "Ensure this value is greater than or equal to 0."),
        ({"target": "cloud"}, "target", "Select a valid choice. cloud is not one of the available choices."),
        ({"config_name": ""}, "config_name", "This field is required."),
        ({"worker_labels": "gpu_type"}, "worker_labels", "bad label 'gpu_type': expected KEY=VALUE, e.g. gpu_type=a100*"),
        ({"config": '{"num_processes": "two"}'}, None, "config num_processes must be an integer, got 'two'"),
    ],
)
def test_a_bad_submission_shows_the_error_and_creates_nothing(admin_client, commit, fields, field, error):
    WorkerFactory(gpu_count=8)

    with commit():
        response = admin_client.post(ADD, submission(**fields))

    assert response.status_code == 200
    errors = response.context["form"].errors
    assert errors[field or "__all__"] == [error]
    assert not Job.objects.exists()
    assert audit_rows() == []
    assert sent_events() == []


# --- the list -------------------------------------------------------------------------------------


def test_the_list_shows_progress_attempts_and_status(admin_client):
    worker = WorkerFactory(name="gpu-box-1")
    running = job_on_worker(
        worker, progress={"fraction": 0.42, "step": 42, "total_steps": 100, "loss": 0.123456}, attempt_count=2, retry_count=1
    )
    done = JobFactory(status=JobStatus.COMPLETED, attempt_count=1, progress={"fraction": 0.97})
    queued = JobFactory()

    rows = changelist_rows(admin_client.get(LIST))

    assert set(rows) == {running, done, queued}
    row = rows[running]
    assert 'role="progressbar" aria-valuenow="42"' in row
    assert "42% · step 42/100 · loss 0.1235" in row
    assert '<span class="st-badge st-running" data-status="running">Running</span>' in row
    assert "retry 1 of 3" in row
    assert '<td class="field-attempts">2 (1 retry)</td>' in row
    assert f'<a href="{admin_url(worker)}">gpu-box-1</a>' in row
    assert 'class="st-progress st-progress-done" role="progressbar" aria-valuenow="100"' in rows[done]
    assert '<td class="field-attempts">1</td>' in rows[done]
    assert "progressbar" not in rows[queued]
    assert 'data-status="queued"' in rows[queued]


def test_filter_by_status_and_the_overview_running_link(admin_client):
    queued = JobFactory()
    dispatched = job_on_worker(WorkerFactory(), status=JobStatus.DISPATCHED)
    running = job_on_worker(WorkerFactory(), status=JobStatus.RUNNING)
    JobFactory(status=JobStatus.FAILED)

    assert listed(admin_client.get(LIST, {"status__exact": "queued"})) == [queued]
    assert set(listed(admin_client.get(LIST, {"status__in": "dispatched,running"}))) == {dispatched, running}


def test_search_by_exact_id_and_config_name(admin_client):
    wanted = JobFactory(config_name="flux-lora")
    JobFactory(config_name="sdxl-full")

    assert listed(admin_client.get(LIST, {"q": wanted.pk})) == [wanted]
    assert listed(admin_client.get(LIST, {"q": "flux"})) == [wanted]


def test_live_rows_for_jobs(admin_client, django_assert_max_num_queries):
    jobs = [job_on_worker(WorkerFactory(), progress={"fraction": 0.5}) for _ in range(5)]
    gone = JobFactory()
    gone_id = gone.pk
    gone.delete()

    with django_assert_max_num_queries(3):
        response = admin_client.get(LIVE, {"ids": ",".join([*(j.pk for j in jobs), gone_id])})

    body = response.json()
    assert set(body["rows"]) == {j.pk for j in jobs}
    assert body["missing"] == [gone_id]
    cells = body["rows"][jobs[0].pk]
    assert set(cells) == {"status_display", "progress_bar", "worker_display", "attempts"}
    assert 'aria-valuenow="50"' in cells["progress_bar"] and cells["attempts"] == "1"


# --- the detail page ------------------------------------------------------------------------------


def test_the_detail_page_shows_attempts_log_error_and_audit_trail(admin_client):
    first, second = WorkerFactory(name="gpu-box-1"), WorkerFactory(name="gpu-box-2")
    job = JobFactory(
        status=JobStatus.FAILED, attempt_count=2, retry_count=1, worker_name="gpu-box-2",
        last_error="CUDA out of memory", log_tail="step 1\n<step 2> & done",
    )  # fmt: skip
    JobAttemptFactory(job=job, number=1, worker=first, outcome=AttemptOutcome.LOST, error="no heartbeat for 60 s")
    JobAttemptFactory(job=job, number=2, worker=second, outcome=AttemptOutcome.FAILED, error="CUDA out of memory")
    AuditEventFactory(target_type="job", target_id=job.pk, action=actions.JOB_SUBMITTED, actor_name="alice")
    AuditEventFactory(target_type="job", target_id="j_someoneelse00", action=actions.JOB_CANCEL_REQUESTED)

    response = admin_client.get(admin_url(job))

    assert response.status_code == 200
    text = response.content.decode()
    (inline,) = response.context["inline_admin_formsets"]
    assert [form.original.number for form in inline] == [1, 2]
    assert f'<a href="{admin_url(first)}">gpu-box-1</a>' in text and "Worker lost" in text
    assert f'<a href="{admin_url(second)}">gpu-box-2</a>' in text and "no heartbeat for 60 s" in text
    assert '<pre class="st-log">step 1\n&lt;step 2&gt; &amp; done</pre>' in text
    assert "CUDA out of memory" in text
    assert "<td>job.submitted</td><td>user:alice</td><td>yes</td>" in text
    assert "job.cancel_requested" not in text
    assert f'href="/admin/audit/auditevent/?q={job.pk}&amp;target_type=job"' in text


def test_the_detail_page_of_a_queued_job_says_why_it_waits(admin_client):
    WorkerFactory(labels={"gpu_type": "h100"})
    job = JobFactory(worker_labels={"gpu_type": "a100*"})

    text = admin_client.get(admin_url(job)).content.decode()

    assert "Why it waits" in text
    assert "no worker with &gt;= 0 GPUs matches labels gpu_type=a100*" in text


def test_the_detail_pages_link_a_retry_and_its_original(admin_client):
    original = JobFactory(status=JobStatus.FAILED)
    first, second = JobFactory(retry_of=original), JobFactory(retry_of=original)

    original_page = admin_client.get(admin_url(original)).content.decode()
    retry_page = admin_client.get(admin_url(first)).content.decode()

    assert (
        f'Retried as <a href="{admin_url(first)}">{first.pk}</a>, <a href="{admin_url(second)}">{second.pk}</a>'
        in original_page
    )
    assert f'Retry of <a href="{admin_url(original)}">{original.pk}</a>' in retry_page
    assert "Retried as" not in retry_page


@pytest.mark.parametrize(
    ("status", "buttons"),
    [
        (JobStatus.QUEUED, {"cancel-job"}),
        (JobStatus.DISPATCHED, {"cancel-job"}),
        (JobStatus.RUNNING, {"cancel-job"}),
        (JobStatus.COMPLETED, set()),
        (JobStatus.FAILED, {"retry-job"}),
        (JobStatus.CANCELLED, {"retry-job"}),
    ],
)
def test_cancel_and_retry_buttons_only_where_they_apply(admin_client, status, buttons):
    job = JobFactory(status=status)

    text = admin_client.get(admin_url(job)).content.decode()

    assert {b for b in ("cancel-job", "retry-job") if f'id="{b}"' in text} == buttons


# --- cancel ---------------------------------------------------------------------------------------


def test_cancel_a_running_job_tells_its_worker(admin_client, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    with commit():
        response = admin_client.post(admin_url(job, "cancel"), {"post": "yes"})

    assert (response.status_code, response["Location"]) == (302, admin_url(job))
    assert admin_messages(response) == [f"Cancelled {job.pk}."]
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED
    assert [(e["type"], e["data"]["job_id"], e["data"]["attempt"]) for e in sent_events(worker.pk)] == [
        ("job_cancel", job.pk, job.lease_id)
    ]
    (row,) = audit_rows(actions.JOB_CANCEL_REQUESTED, target_id=job.pk)
    assert (row.actor_type, row.actor_name, row.details["status"]) == ("user", "admin", "running")


def test_cancel_action_cancels_each_selected_job(admin_client, commit):
    worker = WorkerFactory()
    queued, running, untouched = JobFactory(), job_on_worker(worker), JobFactory()

    with commit():
        response = post_action(admin_client, LIST, "cancel_jobs", [queued, running], post="yes")

    assert response.status_code == 302
    (message,) = admin_messages(response)
    assert message.startswith("Cancelled: ") and set(message[len("Cancelled: ") :].split(", ")) == {queued.pk, running.pk}
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert statuses == {queued.pk: "cancelled", running.pk: "cancelled", untouched.pk: "queued"}
    assert [e["data"]["job_id"] for e in sent_events(worker.pk)] == [running.pk]
    assert {r.target_id for r in audit_rows(actions.JOB_CANCEL_REQUESTED)} == {queued.pk, running.pk}


@pytest.mark.parametrize("how", ["button", "action"])
def test_cancelling_a_finished_job_is_refused(admin_client, commit, how):
    job = JobFactory(status=JobStatus.COMPLETED)

    with commit():
        if how == "button":
            response = admin_client.post(admin_url(job, "cancel"), {"post": "yes"})
        else:
            response = post_action(admin_client, LIST, "cancel_jobs", [job], post="yes")

    assert admin_messages(response) == [f"Refused: job {job.pk} already completed"]
    job.refresh_from_db()
    assert job.status == JobStatus.COMPLETED
    assert audit_rows() == []
    assert sent_events() == []


def test_cancel_and_retry_urls_refuse_get_and_anonymous(admin_client, client):
    job = JobFactory(status=JobStatus.FAILED)

    assert admin_client.get(admin_url(job, "cancel")).status_code == 403
    assert admin_client.get(admin_url(job, "retry")).status_code == 403
    anonymous = client.post(admin_url(job, "retry"), {"post": "yes"})
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    assert Job.objects.count() == 1
    assert audit_rows() == []


def test_staff_who_may_only_view_jobs_can_look_but_not_touch(staff_client, commit):
    client = staff_client("queue.view_job")
    queued, failed = JobFactory(), JobFactory(status=JobStatus.FAILED)

    listing = client.get(LIST)
    assert listing.status_code == 200 and set(listed(listing)) == {queued, failed}
    assert action_names(listing) == set()
    assert ADD not in listing.content.decode()
    assert 'id="cancel-job"' not in client.get(admin_url(queued)).content.decode()
    assert 'id="retry-job"' not in client.get(admin_url(failed)).content.decode()
    with commit():
        assert client.get(ADD).status_code == 403
        assert client.post(ADD, submission()).status_code == 403
        assert client.post(admin_url(queued, "cancel"), {"post": "yes"}).status_code == 403
        assert client.post(admin_url(failed, "retry"), {"post": "yes"}).status_code == 403
        post_action(client, LIST, "cancel_jobs", [queued], post="yes")
        post_action(client, LIST, "retry_jobs", [failed], post="yes")

    assert sorted(Job.objects.values_list("pk", "status")) == sorted([(queued.pk, "queued"), (failed.pk, "failed")])
    assert audit_rows() == []


@pytest.mark.parametrize(
    ("permission", "may"),
    [("queue.cancel_job", {"cancel"}), ("queue.retry_job", {"retry"}), ("queue.submit_job", set())],
)
def test_each_job_action_needs_its_own_permission(staff_client, commit, permission, may):
    client = staff_client("queue.view_job", permission)
    queued, failed = JobFactory(), JobFactory(status=JobStatus.FAILED)

    assert action_names(client.get(LIST)) == {f"{action}_jobs" for action in may}
    with commit():
        cancel = client.post(admin_url(queued, "cancel"), {"post": "yes"})
        retry = client.post(admin_url(failed, "retry"), {"post": "yes"})

    assert cancel.status_code == (302 if "cancel" in may else 403)
    assert retry.status_code == (302 if "retry" in may else 403)
    queued.refresh_from_db()
    assert queued.status == (JobStatus.CANCELLED if "cancel" in may else JobStatus.QUEUED)
    assert Job.objects.filter(retry_of=failed).exists() == ("retry" in may)


def test_submitting_needs_the_submit_permission(staff_client, commit):
    client = staff_client("queue.view_job", "queue.submit_job")

    assert client.get(ADD).status_code == 200
    with commit():
        response = client.post(ADD, submission())

    assert response.status_code == 302
    assert Job.objects.count() == 1


# --- retry ----------------------------------------------------------------------------------------


def test_retry_submits_a_new_job_with_the_same_settings(admin_client, commit):
    worker = WorkerFactory(name="gpu-box-1", labels={"gpu_type": "a100"})
    original = JobFactory(status=JobStatus.FAILED, worker_labels={"gpu_type": "a1*"}, priority=5, config={"lr": 1})

    with commit():
        response = admin_client.post(admin_url(original, "retry"), {"post": "yes"})

    retry = Job.objects.exclude(pk=original.pk).get()
    assert (response.status_code, response["Location"]) == (302, admin_url(retry))
    assert admin_messages(response) == [f"Retried {original.pk} as {retry.pk}: dispatched to gpu-box-1."]
    assert retry.retry_of == original
    assert (retry.config, retry.worker_labels, retry.priority) == ({"lr": 1}, {"gpu_type": "a1*"}, 5)
    assert (retry.status, retry.worker_id) == (JobStatus.DISPATCHED, worker.pk)
    (row,) = audit_rows(actions.JOB_RETRIED, target_id=original.pk)
    assert (row.actor_name, row.details["new_job"]) == ("admin", retry.pk)
    original.refresh_from_db()
    assert original.status == JobStatus.FAILED


def test_retry_action_reports_the_new_jobs(admin_client, commit):
    failed, cancelled, completed = (
        JobFactory(status=JobStatus.FAILED),
        JobFactory(status=JobStatus.CANCELLED),
        JobFactory(status=JobStatus.COMPLETED),
    )

    with commit():
        response = post_action(admin_client, LIST, "retry_jobs", [failed, cancelled, completed], post="yes")

    retries = {job.retry_of_id: job.pk for job in Job.objects.filter(retry_of__isnull=False)}
    assert set(retries) == {failed.pk, cancelled.pk}
    new_jobs, refused, retried = sorted(admin_messages(response))
    assert refused == f"Refused: job {completed.pk} is completed; only failed or cancelled jobs can be retried"
    assert retried.startswith("Retried: ") and set(retried[len("Retried: ") :].split(", ")) == set(retries)
    assert new_jobs.startswith("New jobs: ") and set(new_jobs[len("New jobs: ") :].split(", ")) == set(retries.values())


@pytest.mark.parametrize("status", [JobStatus.COMPLETED, JobStatus.RUNNING, JobStatus.QUEUED])
def test_retrying_an_unfinished_or_completed_job_is_refused(admin_client, commit, status):
    job = JobFactory(status=status)

    with commit():
        response = admin_client.post(admin_url(job, "retry"), {"post": "yes"})

    assert (response.status_code, response["Location"]) == (302, admin_url(job))
    assert admin_messages(response) == [
        f"Refused: job {job.pk} is {status}; only failed or cancelled jobs can be retried"
    ]
    assert list(Job.objects.all()) == [job]
    assert audit_rows() == []


# --- jobs are history -----------------------------------------------------------------------------


def test_jobs_cannot_be_deleted_from_the_admin(admin_client):
    job = JobFactory(status=JobStatus.COMPLETED)

    assert action_names(admin_client.get(LIST)) == {"cancel_jobs", "retry_jobs"}
    assert admin_client.get(admin_url(job, "delete")).status_code == 403
    assert admin_client.post(admin_url(job, "delete"), {"post": "yes"}).status_code == 403
    post_action(admin_client, LIST, "delete_selected", [job], post="yes")
    assert Job.objects.filter(pk=job.pk).exists()


def test_the_job_page_refreshes_its_status_progress_wait_and_log_from_the_detail_cells(admin_client):
    job = JobFactory(log_tail="step 1\nstep 2")

    page = admin_client.get(admin_url(job)).content.decode()
    listed = admin_client.get(LIVE, {"ids": job.pk}).json()["rows"][job.pk]
    detail = admin_client.get(LIVE, {"ids": job.pk, "detail": "1"}).json()["rows"][job.pk]

    assert f'<meta name="simpletuner-live-object" content="{LIVE}" data-id="{job.pk}">' in page
    assert set(listed) == {"status_display", "progress_bar", "worker_display", "attempts"}
    assert set(detail) == set(listed) | {"waiting", "log", "progress_chart"}
    assert "step 1\nstep 2" in detail["log"]
    assert detail["waiting"] == "no worker is registered"


def test_the_list_and_its_live_rows_leave_configs_and_logs_unread(admin_client):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    job = JobFactory(log_tail="x" * 16_000, config={"huge": "y" * 1000})

    for path, params in ((LIST, {}), (LIVE, {"ids": job.pk})):
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get(path, params).status_code == 200
        job_reads = [q["sql"] for q in captured.captured_queries if 'FROM "queue_job"' in q["sql"] and "SELECT" in q["sql"]]
        assert job_reads and not [sql for sql in job_reads if '"log_tail"' in sql or '"queue_job"."config"' in sql]
