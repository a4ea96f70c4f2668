"""The Workers admin pages through the test client: list, live rows, add (token shown once), drain, rotate, delete."""

import html
import re
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from audit import actions
from job_queue.models import Job, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from common import admin_kit, humanize
from workers.admin import LabelFilter
from workers.models import TokenKind, Worker, WorkerStatus, WorkerType
from workers.services import token_authenticate
from workers.tests.factories import UserFactory, WorkerFactory, api_token, worker_token
from workers.tests.support import (
    WORKER_MANAGER_PERMISSIONS,
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

LIST = "/admin/workers/worker/"
ADD = LIST + "add/"
LIVE = LIST + "live/"
TOKENS = "/admin/workers/token/"
MANAGER_PERMISSIONS = WORKER_MANAGER_PERMISSIONS
REFUSED_ONLINE = "Refused: worker {name} is {status}; only an offline worker can be deleted (drain it and stop its agent first)"


def names(response):
    return [worker.name for worker in listed(response)]


def shown_token(response):
    """Return the plaintext token and the agent command line a token page shows."""
    text = response.content.decode()
    token = re.search(r'id="worker-token">([^<]*)</div>', text).group(1)
    command = re.search(r'id="agent-command">([^<]*)</pre>', text).group(1)
    return html.unescape(token), html.unescape(command)


def authenticates(token):
    found = token_authenticate(kind=TokenKind.WORKER, plaintext=token)
    return found.worker_id if found else None


# --- the list ---------------------------------------------------------------------------------------


def test_the_list_shows_status_gpus_labels_current_job_and_heartbeat_age(admin_client, monkeypatch):
    now = timezone.now()
    frozen = SimpleNamespace(now=lambda: now, localtime=timezone.localtime)
    monkeypatch.setattr(admin_kit, "timezone", frozen)
    monkeypatch.setattr(humanize, "timezone", frozen)
    busy = WorkerFactory(
        name="alpha", gpu_count=2, gpu_name="A100", gpu_vram_gb=80, labels={"gpu": "a100", "zone": "eu"},
        last_heartbeat=now - timedelta(seconds=12),
    )  # fmt: skip
    job = job_on_worker(busy, config_name="flux-lora")
    WorkerFactory(name="beta", fresh=True)
    WorkerFactory(name="gamma", stream_id=None, last_heartbeat=now - timedelta(minutes=3, seconds=5))

    response = admin_client.get(LIST)

    assert response.status_code == 200
    rows = {worker.name: row for worker, row in changelist_rows(response).items()}
    assert set(rows) == {"alpha", "beta", "gamma"}
    alpha = rows["alpha"]
    assert '<span class="st-badge st-busy" data-status="busy">Busy</span>' in alpha
    assert "2× A100 · 80 GB" in alpha
    assert '<span class="st-label">gpu=a100</span><span class="st-label">zone=eu</span>' in alpha
    assert f'<a href="{admin_url(job)}">flux-lora</a>' in alpha
    assert ">12 s ago</time>" in alpha
    assert 'class="st-badge st-connecting"' in rows["beta"]
    assert '<span class="st-muted">never</span>' in rows["beta"]
    assert "12 s ago" not in rows["beta"]
    assert "no open stream" in rows["gamma"] and ">3 min ago</time>" in rows["gamma"]


def test_filter_by_status_and_type(admin_client):
    WorkerFactory(name="idle-persistent")
    WorkerFactory(name="offline-ephemeral", offline=True, worker_type=WorkerType.EPHEMERAL)
    WorkerFactory(name="offline-persistent", offline=True)

    assert names(admin_client.get(LIST, {"status__exact": "offline"})) == ["offline-ephemeral", "offline-persistent"]
    assert names(admin_client.get(LIST, {"worker_type__exact": "ephemeral"})) == ["offline-ephemeral"]
    assert names(admin_client.get(LIST, {"status__exact": "idle", "worker_type__exact": "persistent"})) == [
        "idle-persistent"
    ]


@pytest.mark.parametrize(
    ("labels", "wanted"),
    [
        ({"gpu": "a100"}, "gpu=a100"),
        ({"contains": "yes"}, "contains=yes"),  # a key named like a lookup is a key, not a lookup
        ({"gpu__type": "h100"}, "gpu__type=h100"),
        ({"slots": "80"}, "slots=80"),  # a number-like value is still compared as a string
    ],
)
def test_filter_by_one_label(admin_client, labels, wanted):
    WorkerFactory(name="match", labels={**labels, "zone": "eu"})
    key = next(iter(labels))
    WorkerFactory(name="other-value", labels={key: "something-else"})
    WorkerFactory(name="no-labels")

    response = admin_client.get(LIST + "?label=" + wanted.replace("=", "%3D"))

    assert response.status_code == 200
    assert names(response) == ["match"]
    offered = [choice["display"] for choice in _label_filter(response).choices(response.context["cl"])]
    assert wanted in offered and f"{key}=something-else" in offered and "zone=eu" in offered


def _label_filter(response):
    return next(f for f in response.context["cl"].filter_specs if isinstance(f, LabelFilter))


def test_search_by_name_and_by_exact_id(admin_client):
    alpha = WorkerFactory(name="alpha-node")
    WorkerFactory(name="beta-node")

    assert names(admin_client.get(LIST, {"q": "alpha"})) == ["alpha-node"]
    assert names(admin_client.get(LIST, {"q": alpha.pk})) == ["alpha-node"]
    assert names(admin_client.get(LIST, {"q": alpha.pk[:6]})) == []  # ids match exactly, not by prefix


def test_links_reach_objects_whose_id_looks_like_an_admin_escape(admin_client):
    # The admin escapes "_" in URLs as "_5F"; an unescaped id "w_22..." reads back as 'w"...'.
    worker = WorkerFactory(id="w_22aabbccddee", name="escaped")
    job = job_on_worker(worker, id="j_40aabbccddee0011", config_name="flux-lora")
    response = admin_client.post(admin_url(worker, "drain"), {"post": "yes"}, follow=True)

    assert response.status_code == 200
    assert response.context["original"] == worker
    job_link = re.search(r'<a href="([^"]+)">flux-lora</a>', response.content.decode()).group(1)
    assert admin_client.get(job_link).context["original"] == job


# --- live rows ------------------------------------------------------------------------------------


def test_live_rows_answer_the_live_fields_of_the_requested_ids_and_name_the_missing(admin_client):
    busy, idle, unasked = WorkerFactory(), WorkerFactory(), WorkerFactory()
    job_on_worker(busy, config_name="flux-lora")
    gone = WorkerFactory(offline=True)
    gone_id = gone.pk
    gone.delete()

    response = admin_client.get(LIVE, {"ids": f"{busy.pk},{idle.pk},{gone_id}"})

    assert response.status_code == 200
    body = response.json()
    assert set(body["rows"]) == {busy.pk, idle.pk}
    assert unasked.pk not in body["rows"]
    assert body["missing"] == [gone_id]
    assert set(body["rows"][busy.pk]) == {"status_display", "gpus", "current_job_display", "heartbeat"}
    assert 'data-status="busy"' in body["rows"][busy.pk]["status_display"]
    assert "flux-lora" in body["rows"][busy.pk]["current_job_display"]
    assert 'data-status="idle"' in body["rows"][idle.pk]["status_display"]


def test_live_rows_need_a_signed_in_viewer(client, staff_client):
    worker = WorkerFactory()

    anonymous = client.get(LIVE, {"ids": worker.pk})
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    assert staff_client().get(LIVE, {"ids": worker.pk}).status_code == 403
    assert staff_client("workers.view_worker").get(LIVE, {"ids": worker.pk}).json()["rows"].keys() == {worker.pk}


@pytest.mark.parametrize("count", [1, 40])
def test_live_rows_cost_the_same_queries_for_any_number_of_ids(admin_client, django_assert_max_num_queries, count):
    workers = WorkerFactory.create_batch(count)
    for worker in workers:
        job_on_worker(worker)

    # session, user, the rows with their current jobs
    with django_assert_max_num_queries(3):
        response = admin_client.get(LIVE, {"ids": ",".join(w.pk for w in workers)})

    assert len(response.json()["rows"]) == count


# --- add worker -----------------------------------------------------------------------------------


def test_the_add_page_shows_the_form(admin_client):
    response = admin_client.get(ADD)

    assert response.status_code == 200
    text = response.content.decode()
    assert 'id="worker_add_form"' in text
    assert {"name", "worker_type", "labels"} <= set(response.context["form"].fields)


@pytest.mark.parametrize(
    ("worker_type", "flags"), [("persistent", " --persistent"), ("ephemeral", "")]
)
def test_adding_a_worker_shows_its_token_once_with_the_agent_command(admin_client, admin_user, worker_type, flags):
    response = admin_client.post(ADD, {"name": "gpu-box-1", "worker_type": worker_type, "labels": "gpu=a100\nzone = eu\n"})

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"].split(", ")
    worker = Worker.objects.get()
    assert (worker.name, worker.worker_type, worker.labels) == ("gpu-box-1", worker_type, {"gpu": "a100", "zone": "eu"})
    token, command = shown_token(response)
    assert token.startswith("wt_") and authenticates(token) == worker.pk
    assert command == (
        f"SIMPLETUNER_WORKER_TOKEN={token} .venv/bin/simpletuner worker --orchestrator-url http://testserver --name gpu-box-1{flags}"
    )
    (row,) = audit_rows(actions.WORKER_CREATED, target_id=worker.pk)
    assert (row.actor_type, row.actor_id, row.actor_name) == ("user", str(admin_user.pk), "admin")
    assert row.details["token_prefix"] == token[:10]
    # Nowhere else: not on the worker's page, the list, the live rows, nor the add page again.
    for url in (admin_url(worker), LIST, f"{LIVE}?ids={worker.pk}", ADD):
        assert token not in admin_client.get(url).content.decode()


def test_adding_a_taken_name_shows_the_error_and_creates_nothing(admin_client):
    existing = WorkerFactory(name="gpu-box-1")

    response = admin_client.post(ADD, {"name": "gpu-box-1", "worker_type": "persistent", "labels": ""})

    assert response.status_code == 200
    assert response.context["form"].errors["name"] == ["a worker named 'gpu-box-1' already exists"]
    assert "already exists" in response.content.decode()
    assert "wt_" not in response.content.decode()
    assert list(Worker.objects.all()) == [existing]
    assert audit_rows(actions.WORKER_CREATED) == []


@pytest.mark.parametrize(
    ("labels", "error"),
    [
        ("gpu", "bad label 'gpu': expected KEY=VALUE, e.g. gpu=a100"),
        ("=a100", "bad label '=a100': expected KEY=VALUE, e.g. gpu=a100"),
        ("gpu=a100\ngpu=h100", "label 'gpu' given twice"),
    ],
)
def test_bad_labels_are_a_field_error(admin_client, labels, error):
    response = admin_client.post(ADD, {"name": "gpu-box-1", "worker_type": "persistent", "labels": labels})

    assert response.status_code == 200
    assert response.context["form"].errors["labels"] == [error]
    assert not Worker.objects.exists()


def test_the_local_type_is_not_offered(admin_client):
    response = admin_client.post(ADD, {"name": "sneaky", "worker_type": "local"})

    assert "worker_type" in response.context["form"].errors
    assert not Worker.objects.exists()


def test_staff_who_may_only_view_workers_can_look_but_not_touch(staff_client, commit):
    client = staff_client("workers.view_worker")
    worker = WorkerFactory()
    token = worker_token(worker)

    listing = client.get(LIST)
    assert listing.status_code == 200 and names(listing) == [worker.name]
    assert action_names(listing) == set()
    assert ADD not in listing.content.decode()
    detail = client.get(admin_url(worker)).content.decode()
    assert 'id="drain-worker"' not in detail and 'id="rotate-token"' not in detail
    with commit():
        assert client.get(ADD).status_code == 403
        assert client.post(ADD, {"name": "sneaky", "worker_type": "persistent"}).status_code == 403
        assert client.post(admin_url(worker, "drain")).status_code == 403
        assert client.post(admin_url(worker, "rotate")).status_code == 403
        assert client.get(admin_url(worker, "delete")).status_code == 403
        post_action(client, LIST, "drain_workers", [worker])
    worker.refresh_from_db()
    assert (worker.status, worker.drain_requested_at) == (WorkerStatus.IDLE, None)
    assert list(Worker.objects.values_list("name", flat=True)) == [worker.name]
    assert authenticates(token) == worker.pk
    assert audit_rows() == []


# --- drain ----------------------------------------------------------------------------------------


def test_drain_action_drains_each_selected_worker(admin_client, commit):
    idle, busy, untouched = WorkerFactory(name="a-idle"), WorkerFactory(name="b-busy"), WorkerFactory(name="c-idle")
    job = job_on_worker(busy)

    with commit():
        response = post_action(admin_client, LIST, "drain_workers", [idle, busy], post="yes")

    assert response.status_code == 302
    assert admin_messages(response) == ["Draining: a-idle, b-busy"]
    for worker, current_job in ((idle, None), (busy, job.pk)):
        worker.refresh_from_db()
        assert worker.status == WorkerStatus.DRAINING and worker.drain_requested_at is not None
        assert [r.actor_name for r in audit_rows(actions.WORKER_DRAIN_REQUESTED, target_id=worker.pk)] == ["admin"]
        assert [(e["type"], e["data"]["current_job_id"]) for e in sent_events(worker.pk)] == [("drain", current_job)]
    untouched.refresh_from_db()
    assert untouched.status == WorkerStatus.IDLE and sent_events(untouched.pk) == []


def test_drain_button_on_the_worker_page(admin_client, commit):
    worker = WorkerFactory(name="gpu-box-1")

    with commit():
        response = admin_client.post(admin_url(worker, "drain"), {"post": "yes"})

    assert (response.status_code, response["Location"]) == (302, admin_url(worker))
    assert admin_messages(response) == ["Draining: gpu-box-1"]
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.DRAINING
    assert len(audit_rows(actions.WORKER_DRAIN_REQUESTED, target_id=worker.pk)) == 1
    assert [e["type"] for e in sent_events(worker.pk)] == ["drain"]


def test_drain_and_rotate_urls_refuse_get(admin_client):
    worker = WorkerFactory()
    token = worker_token(worker)

    assert admin_client.get(admin_url(worker, "drain")).status_code == 403
    assert admin_client.get(admin_url(worker, "rotate")).status_code == 403
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.IDLE and authenticates(token) == worker.pk


# --- rotate ---------------------------------------------------------------------------------------


def _rotate_by_action(client, worker):
    return post_action(client, LIST, "rotate_token", [worker], post="yes")


def _rotate_by_button(client, worker):
    return client.post(admin_url(worker, "rotate"), {"post": "yes"})


@pytest.mark.parametrize("rotate", [_rotate_by_action, _rotate_by_button])
def test_rotate_shows_a_new_token_once_and_the_old_one_stops_working(admin_client, commit, control_messages, rotate):
    worker = WorkerFactory(name="gpu-box-1")
    old = worker_token(worker)
    old_token_id = token_authenticate(kind=TokenKind.WORKER, plaintext=old).pk

    with commit():
        response = rotate(admin_client, worker)

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"].split(", ")
    new, command = shown_token(response)
    assert new != old
    assert command.startswith(f"SIMPLETUNER_WORKER_TOKEN={new} .venv/bin/simpletuner worker ")
    assert authenticates(old) is None
    assert authenticates(new) == worker.pk
    (row,) = audit_rows(actions.WORKER_TOKEN_ROTATED, target_id=worker.pk)
    assert (row.actor_type, row.actor_name, row.details["revoked_tokens"]) == ("user", "admin", 1)
    assert control_messages == [
        (f"_control:worker-{worker.pk}", "revoke", {"tokens": [f"token:{old_token_id}"], "reason": "token rotated", "code": "token_revoked"})
    ]
    assert new not in admin_client.get(admin_url(worker)).content.decode()


def test_rotate_action_with_two_workers_rotates_nothing(admin_client, commit, control_messages):
    first, second = WorkerFactory(), WorkerFactory()
    tokens = {first.pk: worker_token(first), second.pk: worker_token(second)}

    with commit():
        response = post_action(admin_client, LIST, "rotate_token", [first, second])

    assert response.status_code == 302
    assert admin_messages(response) == ["Select exactly one worker to rotate its token."]
    assert {pk: authenticates(token) for pk, token in tokens.items()} == {first.pk: first.pk, second.pk: second.pk}
    assert audit_rows(actions.WORKER_TOKEN_ROTATED) == []
    assert control_messages == []


# --- delete ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.DRAINING])
@pytest.mark.parametrize("method", ["get", "post"])
def test_deleting_an_online_worker_is_refused(admin_client, commit, status, method):
    worker = WorkerFactory(name="gpu-box-1", status=status)

    with commit():
        response = getattr(admin_client, method)(admin_url(worker, "delete"), {"post": "yes"} if method == "post" else {})

    assert (response.status_code, response["Location"]) == (302, admin_url(worker))
    assert admin_messages(response) == [REFUSED_ONLINE.format(name="gpu-box-1", status=status)]
    assert Worker.objects.filter(pk=worker.pk).exists()
    assert audit_rows(actions.WORKER_DELETED) == []


@pytest.mark.parametrize("traits", [{"offline": True}, {"fresh": True}], ids=["offline", "never-connected"])
def test_deleting_an_offline_worker_keeps_its_jobs(staff_client, commit, control_messages, traits):
    # An operator, not a superuser: the worker's tokens go with it without a permission of their own.
    client = staff_client(*MANAGER_PERMISSIONS)
    worker = WorkerFactory(name="gpu-box-1", **traits)
    token = worker_token(worker)
    job = JobFactory(status=JobStatus.COMPLETED, worker=worker, worker_name=worker.name)

    confirm = client.get(admin_url(worker, "delete"))
    assert confirm.status_code == 200
    assert "Are you sure" in confirm.content.decode() and not confirm.context["perms_lacking"]
    with commit():
        response = client.post(admin_url(worker, "delete"), {"post": "yes"})

    assert (response.status_code, response["Location"]) == (302, LIST)
    assert admin_messages(response) == ["Deleted worker gpu-box-1; its jobs and audit trail are kept."]
    assert not Worker.objects.filter(pk=worker.pk).exists()
    job.refresh_from_db()
    assert (job.worker_id, job.worker_name) == (None, "gpu-box-1")
    (row,) = audit_rows(actions.WORKER_DELETED, target_id=worker.pk)
    assert row.actor_type == "user" and row.details["name"] == "gpu-box-1"
    assert authenticates(token) is None
    assert [kind for _, kind, _ in control_messages] == ["revoke"]


def test_delete_action_deletes_offline_workers_and_refuses_each_online_one(admin_client, commit):
    gone = [WorkerFactory(name="a-offline", offline=True), WorkerFactory(name="b-offline", offline=True)]
    idle, busy = WorkerFactory(name="c-idle"), WorkerFactory(name="d-busy")
    job_on_worker(busy)

    with commit():
        response = post_action(admin_client, LIST, "delete_workers", [*gone, idle, busy], post="yes")

    assert response.status_code == 302
    assert sorted(admin_messages(response)) == sorted(
        [
            REFUSED_ONLINE.format(name="c-idle", status="idle"),
            REFUSED_ONLINE.format(name="d-busy", status="busy"),
            "Deleted: a-offline, b-offline",
        ]
    )
    assert sorted(Worker.objects.values_list("name", flat=True)) == ["c-idle", "d-busy"]
    assert {r.target_id for r in audit_rows(actions.WORKER_DELETED)} == {w.pk for w in gone}
    assert Job.objects.count() == 1


def test_the_default_bulk_delete_is_not_offered(admin_client):
    worker = WorkerFactory(offline=True)

    assert action_names(admin_client.get(LIST)) == {"drain_workers", "undrain_workers", "rotate_token", "delete_workers"}
    response = post_action(admin_client, LIST, "delete_selected", [worker], post="yes")

    assert response.status_code == 302
    assert admin_messages(response) == ["No action selected."]
    assert Worker.objects.filter(pk=worker.pk).exists()
    assert audit_rows(actions.WORKER_DELETED) == []


# --- review fixes ----------------------------------------------------------------------------------


MARKUP = "<img src=x onerror=alert(1)>"


def test_live_rows_escape_what_agents_and_deleted_workers_named_as_the_list_does(admin_client):
    worker = WorkerFactory(gpu_count=1, gpu_name=MARKUP)  # an agent reports its GPU's name at register
    orphan = JobFactory(status=JobStatus.FAILED, worker=None, worker_name=MARKUP)  # its worker was deleted

    workers = admin_client.get(LIVE, {"ids": worker.pk}).json()["rows"][worker.pk]
    jobs = admin_client.get("/admin/queue/job/live/", {"ids": orphan.pk}).json()["rows"][orphan.pk]

    for cell in (workers["gpus"], jobs["worker_display"]):
        assert MARKUP not in cell and html.escape(MARKUP, quote=False) in cell
    assert MARKUP not in admin_client.get(LIST).content.decode()


def test_list_pages_name_the_url_their_rows_refresh_from_and_other_lists_do_not(admin_client):
    assert f'<meta name="simpletuner-live-rows" content="{LIVE}">' in admin_client.get(LIST).content.decode()
    assert "simpletuner-live-rows" not in admin_client.get("/admin/auth/user/").content.decode()


def test_tokens_cannot_be_deleted_from_the_admin_even_by_a_superuser(admin_client):
    worker = WorkerFactory()
    worker_token(worker)
    token_id = worker.tokens.get().pk

    response = admin_client.post(f"/admin/workers/token/{token_id}/delete/", {"post": "yes"})

    assert response.status_code == 403
    assert worker.tokens.filter(pk=token_id).exists()


@pytest.mark.parametrize(
    ("permission", "action", "button"),
    [
        ("workers.drain_worker", "drain_workers", "drain"),
        ("workers.rotate_worker_token", "rotate_token", "rotate"),
        ("workers.delete_worker", "delete_workers", None),
    ],
)
def test_each_worker_action_needs_its_own_permission(staff_client, permission, action, button):
    client = staff_client("workers.view_worker", permission)
    worker = WorkerFactory(offline=True)

    # Undrain is drain's other half: the same permission.
    assert action_names(client.get(LIST)) == ({action, "undrain_workers"} if action == "drain_workers" else {action})
    detail = client.get(admin_url(worker)).content.decode()
    shown = {b for b, marker in [("drain", 'id="drain-worker"'), ("rotate", 'id="rotate-token"')] if marker in detail}
    assert shown == ({button} if button else set())
    assert ('id="delete-worker"' in detail) == (button is None)
    for other in {"drain", "rotate"} - {button}:
        assert client.post(admin_url(worker, other)).status_code == 403
    assert (client.get(admin_url(worker, "delete")).status_code == 200) == (button is None)
    assert client.get(ADD).status_code == 403


def test_revoking_operator_api_tokens_needs_its_permission_and_is_audited(staff_client, commit):
    owner = UserFactory(username="prometheus")
    api_token(owner)
    token = owner.api_tokens.get()
    viewer = staff_client("workers.view_token")
    assert action_names(viewer.get(TOKENS)) == set()
    post_action(viewer, TOKENS, "revoke_api_tokens", [token], post="yes")
    token.refresh_from_db()
    assert token.revoked_at is None

    manager = staff_client("workers.view_token", "workers.manage_api_tokens")
    with commit():
        response = post_action(manager, TOKENS, "revoke_api_tokens", [token], post="yes")

    assert admin_messages(response) == [f"Revoked 1 API token(s): {token.prefix}"]
    token.refresh_from_db()
    assert token.revoked_at is not None
    (row,) = audit_rows(actions.API_TOKEN_REVOKED)
    assert (row.target_type, row.target_id, row.details) == (
        "user",
        str(owner.pk),
        {"username": "prometheus", "token_prefix": token.prefix},
    )


def test_worker_tokens_are_rotated_not_revoked_from_the_token_list(admin_client):
    worker = WorkerFactory()
    worker_token(worker)
    token = worker.tokens.get()

    response = post_action(admin_client, TOKENS, "revoke_api_tokens", [token], post="yes")

    assert admin_messages(response) == ["Refused: worker tokens are rotated from their worker's page, not revoked here."]
    token.refresh_from_db()
    assert token.revoked_at is None
    assert audit_rows() == []


def test_the_label_filter_offers_every_key_even_beside_a_high_cardinality_one(rf, admin_user):
    for n in range(60):
        WorkerFactory(labels={"host": f"h{n:04d}", "zone": "eu"})
    request = rf.get(LIST)
    request.user = admin_user
    from django.contrib import admin as django_admin

    model_admin = django_admin.site._registry[Worker]

    choices = [value for value, _ in LabelFilter(request, {}, Worker, model_admin).lookups(request, model_admin)]

    assert "zone=eu" in choices
    assert len([c for c in choices if c.startswith("host=")]) == 20


# --- one registration -----------------------------------------------------------------------------


def test_the_workers_page_is_registered_once_as_the_fleet_admin():
    """job_queue registers the Workers page; workers.admin defines its base and registers no Worker page."""
    import importlib.util
    from unittest import mock

    from django.contrib import admin as django_admin
    from django.contrib.admin.sites import AdminSite

    import workers.admin
    from job_queue.worker_admin import FleetWorkerAdmin

    assert type(django_admin.site._registry[Worker]) is FleetWorkerAdmin

    probe_site = AdminSite(name="probe")
    spec = importlib.util.spec_from_file_location("workers.admin_probe", workers.admin.__file__)
    module = importlib.util.module_from_spec(spec)
    with mock.patch("django.contrib.admin.sites.site", probe_site), mock.patch.object(django_admin, "site", probe_site):
        spec.loader.exec_module(module)  # workers/admin.py's module code, registering on the probe site

    assert Worker not in probe_site._registry
    assert type(django_admin.site._registry[Worker]) is FleetWorkerAdmin
