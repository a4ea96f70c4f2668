"""The authorisation matrix, generated from the URL configuration and the admin's registry.

Every route outside the Django admin, each HTTP method its view serves, and each kind of caller that
must be refused: the expected status, and that nothing changed (the workers, tokens, jobs,
attempts and stored events are as before, and no audit row records a success; a refusal may be
audited, with ``success=False``). Then the caller holding just the route's permission is not refused.
The same for every action, button, add and delete page of our apps' admin pages.

A route, method, admin action or button without an entry here fails ``test_every_*_has_an_entry``.
"""

from urllib.parse import urlencode

import pytest
from asgiref.sync import async_to_sync
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from django.test import AsyncClient, RequestFactory
from django.utils import timezone
from django.urls import URLResolver, get_resolver, reverse
from django_eventstream.models import Event
from rest_framework.response import Response
from rest_framework.test import APIClient, APIRequestFactory, force_authenticate
from rest_framework.views import APIView

from artifacts.models import Artifact
from artifacts.tokens import upload_token
from audit.models import AuditEvent
from tenancy.models import Limits, Team
from training_configs.models import TrainingConfig
from webhooks.models import Delivery, DeliveryStatus, Webhook
from job_queue.models import Job, JobAttempt, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Token, Worker, WorkerStatus, hash_token
from worker_agent.protocol import STREAM_PATH
from workers.tests.factories import UserFactory, WorkerFactory, api_token, worker_token

# --- the matrix ---------------------------------------------------------------------------------------

WORKER, OPERATOR, UPLOAD = "worker", "operator", "upload"  # upload: an attempt's upload token (X-Upload-Token)
SIGNED_IN = "any signed-in operator"  # needs no permission, only an operator's credentials

# route name -> (who calls it, {method: permission}, how another worker's token is refused, or None)
ROUTES = {
    "worker-register": (WORKER, {"POST": WORKER}, 403),
    "worker-heartbeat": (WORKER, {"POST": WORKER}, 403),
    "worker-job-status": (WORKER, {"POST": WORKER}, 409),  # the job is another worker's: stale_report
    "worker-queue": (WORKER, {"GET": WORKER, "POST": WORKER}, 403),
    "worker-disconnect": (WORKER, {"POST": WORKER}, 403),
    "worker-stream": (WORKER, {"GET": WORKER}, 403),
    # The artifact store's attempt side: another attempt's token (one that no longer holds its job) is a 409.
    "artifact-object": (UPLOAD, {"GET": UPLOAD, "PUT": UPLOAD}, 409),
    "checkpoint-complete": (UPLOAD, {"POST": UPLOAD}, 409),
    "artifact-download": (OPERATOR, {"GET": "artifacts.download_artifact"}, None),
    "config-list": (OPERATOR, {"GET": "configs.view_trainingconfig", "POST": "configs.add_trainingconfig"}, None),
    "config-detail": (OPERATOR, {"GET": "configs.view_trainingconfig"}, None),
    "config-list-slash": (OPERATOR, {"GET": "configs.view_trainingconfig", "POST": "configs.add_trainingconfig"}, None),
    "config-detail-slash": (OPERATOR, {"GET": "configs.view_trainingconfig"}, None),
    "admin-workers": (OPERATOR, {"GET": "workers.view_worker", "POST": "workers.add_worker"}, None),
    "admin-worker": (OPERATOR, {"GET": "workers.view_worker", "DELETE": "workers.delete_worker"}, None),
    "admin-worker-drain": (OPERATOR, {"POST": "workers.drain_worker"}, None),
    "admin-worker-token": (OPERATOR, {"POST": "workers.rotate_worker_token"}, None),
    "admin-worker-undrain": (OPERATOR, {"POST": "workers.drain_worker"}, None),
    "admin-worker-labels": (OPERATOR, {"PUT": "workers.change_worker"}, None),
    "queue-list": (OPERATOR, {"GET": "queue.view_job"}, None),
    "queue-submit": (OPERATOR, {"POST": "queue.submit_job"}, None),
    "queue-job": (OPERATOR, {"GET": "queue.view_job"}, None),
    "queue-job-cancel": (OPERATOR, {"POST": "queue.cancel_job"}, None),
    "queue-job-retry": (OPERATOR, {"POST": "queue.retry_job"}, None),
    "queue-job-log": (OPERATOR, {"GET": "queue.view_job"}, None),
    "audit-list": (OPERATOR, {"GET": "audit.view_auditevent"}, None),
    "admin-webhooks": (OPERATOR, {"GET": "webhooks.view_webhook", "POST": "webhooks.add_webhook"}, None),
    "admin-webhook": (
        OPERATOR, {"GET": "webhooks.view_webhook", "PATCH": "webhooks.change_webhook", "DELETE": "webhooks.delete_webhook"}, None
    ),
    "admin-webhook-deliveries": (OPERATOR, {"GET": "webhooks.view_webhook"}, None),
    "admin-webhook-redeliver": (OPERATOR, {"POST": "webhooks.redeliver_webhook"}, None),
    "admin-teams": (OPERATOR, {"GET": "tenancy.view_team", "POST": "tenancy.add_team"}, None),
    "admin-team": (
        OPERATOR, {"GET": "tenancy.view_team", "PATCH": "tenancy.change_team", "DELETE": "tenancy.delete_team"}, None
    ),
    "admin-team-limits": (OPERATOR, {"PUT": "tenancy.set_limits"}, None),
    "admin-user-limits": (OPERATOR, {"PUT": "tenancy.set_limits"}, None),
    "admin-limits": (OPERATOR, {"GET": "tenancy.view_team", "PUT": "tenancy.set_limits"}, None),
    "usage": (OPERATOR, {"GET": "tenancy.view_usage"}, None),
    "api-schema": (OPERATOR, {"GET": SIGNED_IN}, None),
    "api-docs": (OPERATOR, {"GET": SIGNED_IN}, None),
    "metrics": (OPERATOR, {"GET": SIGNED_IN}, None),  # SIMPLETUNER_METRICS=operators, the default
}
# Open to anyone by design: the browsable API's sign-in and sign-out pages; the landing page at / (links
# only) and the favicon.
PUBLIC = {"login", "logout", "landing", "favicon"}

# (app_label.model, action) -> permission, for the admin of our apps. Actions are list actions,
# "button:<name>" the detail page's buttons, "add" and "delete" the add and delete pages.
ADMIN_ACTIONS = {
    ("workers.worker", "add"): "workers.add_worker",
    ("workers.worker", "delete"): "workers.delete_worker",
    ("workers.worker", "drain_workers"): "workers.drain_worker",
    ("workers.worker", "rotate_token"): "workers.rotate_worker_token",
    ("workers.worker", "delete_workers"): "workers.delete_worker",
    ("workers.worker", "button:drain"): "workers.drain_worker",
    ("workers.worker", "button:rotate"): "workers.rotate_worker_token",
    ("workers.worker", "undrain_workers"): "workers.drain_worker",
    ("workers.worker", "button:undrain"): "workers.drain_worker",
    ("workers.worker", "button:labels"): "workers.change_worker",
    ("workers.token", "revoke_api_tokens"): "workers.manage_api_tokens",
    ("workers.token", "add"): "workers.manage_api_tokens",
    ("queue.job", "add"): "queue.submit_job",
    ("queue.job", "cancel_jobs"): "queue.cancel_job",
    ("queue.job", "retry_jobs"): "queue.retry_job",
    ("queue.job", "button:cancel"): "queue.cancel_job",
    ("queue.job", "button:retry"): "queue.retry_job",
    ("configs.trainingconfig", "add"): "configs.add_trainingconfig",
    ("tenancy.team", "add"): "tenancy.add_team",
    ("tenancy.team", "delete"): "tenancy.delete_team",
    ("webhooks.webhook", "add"): "webhooks.add_webhook",
    ("webhooks.webhook", "delete"): "webhooks.delete_webhook",
    ("webhooks.delivery", "redeliver_deliveries"): "webhooks.redeliver_webhook",
    ("webhooks.delivery", "button:redeliver"): "webhooks.redeliver_webhook",
}
OUR_APPS = {"workers", "queue", "audit", "artifacts", "configs", "webhooks", "tenancy"}
# What an admin page needs to be reached at all, beside the action's own permission.
ADMIN_VIEW = {
    "workers.worker": "workers.view_worker",
    "workers.token": "workers.view_token",
    "queue.job": "queue.view_job",
    "configs.trainingconfig": "configs.view_trainingconfig",
    "tenancy.team": "tenancy.view_team",
    "webhooks.webhook": "webhooks.view_webhook",
    "webhooks.delivery": "webhooks.view_webhook",
}


# --- what the URL configuration and the admin offer ----------------------------------------------------


def _walk(patterns, prefix=""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern


def _methods(pattern):
    view = getattr(pattern.callback, "view_class", None) or getattr(pattern.callback, "cls", None)
    if view is None:  # a plain (async) function view: the worker stream answers GET only
        return {"GET"}
    return {m.upper() for m in view.http_method_names if hasattr(view, m) and m not in ("options", "head")}


def discovered_routes():
    """Return ``{(route name, method)}`` for every route outside the Django admin (the admin is below)."""
    found = set()
    for route, pattern in _walk(get_resolver().url_patterns):
        if route.startswith("admin/"):
            continue
        found |= {(pattern.name, method) for method in _methods(pattern)}
    return found


def discovered_admin_actions():
    """Return ``{(app_label.model, action)}`` for every action, button, add and delete page of our apps' admin."""
    superuser = UserFactory.build(is_superuser=True, is_staff=True)
    request = RequestFactory().get("/admin/")
    request.user = superuser
    found = set()
    for model, model_admin in admin.site._registry.items():
        label = f"{model._meta.app_label}.{model._meta.model_name}"
        if model._meta.app_label not in OUR_APPS:
            continue
        found |= {(label, name) for name in model_admin.get_actions(request) if name != "delete_selected"}
        found |= {(label, f"button:{name}") for name in getattr(model_admin, "object_buttons", ())}
        found |= {(label, page) for page in ("add", "delete") if getattr(model_admin, f"has_{page}_permission")(request)}
    return found


MATRIX = sorted((name, method) for name, (_, methods, _) in ROUTES.items() for method in methods)


def test_every_route_has_an_entry_and_every_entry_a_route():
    assert discovered_routes() - {(n, m) for n, m in discovered_routes() if n in PUBLIC} == set(MATRIX)


@pytest.mark.django_db
def test_every_admin_action_has_an_entry_and_every_entry_an_action():
    assert discovered_admin_actions() == set(ADMIN_ACTIONS)


# --- the world a caller meets --------------------------------------------------------------------------


def revoke(plaintext):
    Token.objects.filter(digest=hash_token(plaintext)).update(revoked_at="2024-01-01T00:00:00Z")


class World:
    """Worker A (busy with a running job) and B, each with its token; the objects routes name; the callers' secrets."""

    def __init__(self):
        self.a, self.b = WorkerFactory(name="worker-a"), WorkerFactory(name="worker-b")
        self.a_token, self.b_token = worker_token(self.a), worker_token(self.b)
        self.a_job = job_on_worker(self.a)
        self.revoked_worker_token = worker_token(self.a)
        revoke(self.revoked_worker_token)
        gone = WorkerFactory(name="worker-gone", offline=True)
        self.deleted_worker_token = worker_token(gone)
        gone.delete()
        self.offline = WorkerFactory(name="worker-offline", offline=True)
        self.queued, self.failed = JobFactory(), JobFactory(status=JobStatus.FAILED)
        self.upload_token = upload_token(self.a_job.lease_id)
        stale = job_on_worker(WorkerFactory(name="worker-requeued"))
        self.stale_upload_token = upload_token(stale.lease_id)
        Job.objects.filter(pk=stale.pk).update(status=JobStatus.QUEUED, lease_id=None, worker=None)
        self.artifact = Artifact.objects.create(
            job_id=self.failed.pk, key="out/model.bin", storage_name="outputs/none", size=0, sha256="0" * 64,
            lease_id="a_gone", attempt_number=1,
        )
        self.webhook, self.delivery = webhook_with_an_ended_delivery()
        root = UserFactory(is_superuser=True, is_staff=True)
        self.root, self.team = root, Team.objects.create(name="matrix-team")
        self.operator_token = api_token(root)
        self.revoked_operator_token = api_token(root)
        revoke(self.revoked_operator_token)

    def url(self, name, *, job=None, query=None):
        kwargs = {}
        if name in ("admin-worker", "admin-worker-drain", "admin-worker-token", "admin-worker-undrain", "admin-worker-labels"):
            kwargs["worker_id"] = self.offline.pk
        if name == "worker-job-status":
            kwargs["job_id"] = self.a_job.pk
        if name in ("queue-job", "queue-job-cancel", "queue-job-log"):
            kwargs["job_id"] = self.queued.pk
        if name == "queue-job-retry":
            kwargs["job_id"] = self.failed.pk
        if name == "artifact-object":
            kwargs.update(bucket="out", key="checkpoint-5/model.bin")
        if name == "checkpoint-complete":
            kwargs["step"] = "5"
        if name == "artifact-download":
            kwargs["artifact_id"] = self.artifact.pk
        if name in ("config-detail", "config-detail-slash"):
            kwargs["name"] = "sdxl-lora"
        if name in ("admin-webhook", "admin-webhook-deliveries", "admin-webhook-redeliver"):
            kwargs["webhook_id"] = self.webhook.pk
        if name == "admin-webhook-redeliver":
            kwargs["delivery_id"] = self.delivery.delivery_id
        if name in ("admin-team", "admin-team-limits"):
            kwargs["team"] = self.team.name
        if name == "admin-user-limits":
            kwargs["username"] = self.root.username
        return reverse(name, kwargs=kwargs) + (f"?{urlencode(query)}" if query else "")


def webhook_with_an_ended_delivery():
    """A webhook (to a literal public address: nothing to resolve) and a failed delivery of it, to redeliver."""
    hook = Webhook.objects.create(url="https://93.184.215.14/hook", events=["job.failed"], secret="s" * 20)
    now = timezone.now()
    delivery = Delivery.objects.create(
        webhook=hook, event="job.failed", subject="job:j_gone", occurred_at=now, body="{}", status=DeliveryStatus.FAILED,
        retry_until=now, attempts=1,
    )  # fmt: skip
    return hook, delivery


def state():
    """What a refused request must leave as it was."""
    return {
        "workers": list(Worker.objects.order_by("pk").values()),
        "tokens": list(Token.objects.order_by("pk").values("pk", "kind", "worker_id", "user_id", "revoked_at")),
        "jobs": list(Job.objects.order_by("pk").values()),
        "attempts": list(JobAttempt.objects.order_by("pk").values()),
        "artifacts": list(Artifact.objects.order_by("pk").values()),
        "configs": list(TrainingConfig.objects.order_by("pk").values()),
        "webhooks": list(Webhook.objects.order_by("pk").values()) + list(Delivery.objects.order_by("pk").values()),
        "teams": list(Team.objects.order_by("pk").values()) + list(Team.members.through.objects.order_by("pk").values()),
        "limits": list(Limits.objects.order_by("pk").values()),
        "events": Event.objects.count(),
        "successful audit rows": list(AuditEvent.objects.filter(success=True).values_list("pk", flat=True)),
    }


def _client(**credentials):
    client = APIClient()
    client.credentials(**credentials)
    return client


def _call(client, method, url, body=None):
    if url.startswith(STREAM_PATH):  # an async view: called as the ASGI server calls it
        headers = {key[5:].replace("_", "-").title(): value for key, value in client._credentials.items()}
        return async_to_sync(AsyncClient().get)(url, headers=headers)
    if method == "GET":
        return client.get(url)
    return getattr(client, method.lower())(url, body or {}, format="json")


def _upload_client(secret):
    return _client(HTTP_X_UPLOAD_TOKEN=secret)


def refusing_callers(world, kind, permission, another_worker_status):
    """Return ``[(caller, client, expected status, url query, body)]``: every caller the route must refuse."""
    bearer = lambda secret: _client(HTTP_AUTHORIZATION=f"Bearer {secret}")  # noqa: E731
    worker = lambda secret: _client(HTTP_X_WORKER_TOKEN=secret)  # noqa: E731
    if kind == UPLOAD:
        return [
            ("none", _client(), 401, None, None),
            ("malformed token", _upload_client("not a token!"), 401, None, None),
            ("a token signed with another key", _upload_client("stu_" + world.a_job.lease_id + ":forged"), 401, None, None),
            ("a worker token", worker(world.a_token), 401, None, None),
            ("an operator token", bearer(world.operator_token), 401, None, None),
            ("the token of an attempt that lost its job", _upload_client(world.stale_upload_token), another_worker_status, None, None),
        ]
    own = bearer if kind == OPERATOR else worker
    callers = [
        ("none", _client(), 401, None, None),
        ("malformed token", own("not a token!"), 401, None, None),
        ("revoked token", own(world.revoked_operator_token if kind == OPERATOR else world.revoked_worker_token), 401, None, None),
        ("deleted worker's token", worker(world.deleted_worker_token), 401, None, None),
    ]
    if kind == OPERATOR:
        callers.append(("worker token on an operator route", worker(world.a_token), 401, None, None))
        if permission != SIGNED_IN:
            everything_else = [p for p in _all_permissions() if p != permission]
            callers += [
                ("operator lacking the permission", bearer(api_token(UserFactory(permissions=everything_else))), 403, None, None),
                ("operator with no permission", bearer(api_token(UserFactory())), 403, None, None),
                ("signed-in non-staff user without it", _session(UserFactory()), 403, None, None),
            ]
    else:
        callers.append(("operator token on a worker route", bearer(world.operator_token), 401, None, None))
        claim = {"worker_id": world.a.pk}
        body = {"status": "running", "attempt": world.a_job.lease_id} if another_worker_status == 409 else claim
        callers.append(("another worker's token", worker(world.b_token), another_worker_status, claim, body))
    return callers


def _all_permissions():
    return [
        f"{p.content_type.app_label}.{p.codename}"
        for p in Permission.objects.select_related("content_type").filter(content_type__app_label__in=OUR_APPS)
    ]


def _session(user):
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture(autouse=True)
def no_throttling(settings):
    """The matrix is about who is refused, not how often: the failed-authentication rate is out of reach."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"failed_auth": "100000/min"}}


STREAM_MATRIX = [(n, m) for n, m in MATRIX if n == "worker-stream"]
VIEW_MATRIX = [(n, m) for n, m in MATRIX if n != "worker-stream"]


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "method"), VIEW_MATRIX, ids=[f"{m} {n}" for n, m in VIEW_MATRIX])
def test_route(name, method):
    check_route(name, method)


# The stream authenticates in a thread of its own, with its own connection: it must see committed rows.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("name", "method"), STREAM_MATRIX, ids=[f"{m} {n}" for n, m in STREAM_MATRIX])
def test_stream_route(name, method):
    check_route(name, method)


def check_route(name, method):
    """Every refusing caller gets its status and changes nothing; the holder of the permission is served."""
    kind, methods, another_worker_status = ROUTES[name]
    world = World()
    permission = methods[method]

    for caller, client, expected, query, body in refusing_callers(world, kind, permission, another_worker_status):
        url = world.url(name, query=query if method == "GET" or name == "worker-queue" else None)
        before = state()
        response = _call(client, method, url, body)
        assert response.status_code == expected, f"{caller}: {response.status_code} {response.content[:300]!r}"
        if expected in (401, 403) and response["Content-Type"].startswith("application/json"):
            # (the schema and docs views answer in their own formats, YAML and HTML)
            assert response.json()["code"] == {401: "not_authenticated", 403: "permission_denied"}[expected], caller
        assert state() == before, f"{caller} changed something"

    if name == "worker-stream":
        return  # an accepted stream stays open; tests/e2e open real ones
    if kind == UPLOAD:
        allowed = _upload_client(world.upload_token)
    else:
        allowed = _client(HTTP_X_WORKER_TOKEN=world.a_token) if kind == WORKER else _permitted(permission)
    response = _call(allowed, method, world.url(name), {"name": "a-new-one", "config_name": "c", "config": {}})
    assert response.status_code not in (401, 403, 429), f"{response.status_code} {response.content[:300]!r}"


def _permitted(permission):
    user = UserFactory(permissions=[] if permission == SIGNED_IN else [permission])
    return _client(HTTP_AUTHORIZATION=f"Bearer {api_token(user)}")


@pytest.mark.django_db
def test_options_and_head_need_credentials_too():
    world = World()
    for name in sorted(ROUTES):
        if name == "worker-stream":  # GET only: 405 before anything else
            continue
        assert APIClient().options(world.url(name)).status_code == 401, name
        assert APIClient().head(world.url(name)).status_code == 401, name


# --- the admin ---------------------------------------------------------------------------------------


class AdminWorld:
    def __init__(self):
        self.worker = WorkerFactory(offline=True)
        worker_token(self.worker)
        self.drained = WorkerFactory(status=WorkerStatus.DRAINING, drain_requested_at=timezone.now())
        self.job, self.failed = JobFactory(), JobFactory(status=JobStatus.FAILED)
        api_token(UserFactory())
        self.api_token = Token.objects.filter(kind="api").first()
        self.webhook, self.delivery = webhook_with_an_ended_delivery()
        self.team = Team.objects.create(name="matrix-admin-team")

    def target(self, label, action):
        if label == "tenancy.team":
            return self.team
        if label == "workers.worker":
            return self.drained if "undrain" in action else self.worker
        if label == "workers.token":
            return self.api_token
        if label == "webhooks.webhook":
            return self.webhook
        if label == "webhooks.delivery":
            return self.delivery
        return self.failed if "retry" in action else self.job


ADD_FORMS = {
    "workers.worker": {"name": "new-one", "worker_type": "persistent", "labels": ""},
    "queue.job": {"config_name": "c", "config": "{}", "target": "worker", "priority": "0"},
    "tenancy.team": {"name": "matrix-new-team"},
    "workers.token": {"description": "matrix", "expires": "7"},  # user: the caller (set by admin_request)
    "configs.trainingconfig": {"name": "sdxl-lora", "config": '{"lr": 1}', "dataloader": "", "description": ""},
    "webhooks.webhook": {"url": "https://93.184.215.14/new", "events": ["job.failed"], "secret": "s" * 20, "format": "json"},
}


BUTTON_FORMS = {"button:labels": {"labels": "team=matrix"}}


def admin_request(client, label, action, target):
    app_label, model_name = label.split(".")
    changelist = reverse(f"admin:{app_label}_{model_name}_changelist")
    if action == "add":
        form = dict(ADD_FORMS[label])
        if label == "workers.token":
            form["user"] = client.session.get("_auth_user_id", "")
        return client.post(reverse(f"admin:{app_label}_{model_name}_add"), form)
    if action == "delete":
        return client.post(reverse(f"admin:{app_label}_{model_name}_delete", args=[quote(target.pk)]), {"post": "yes"})
    if action.startswith("button:"):
        button = action.split(":", 1)[1]
        url = reverse(f"admin:{app_label}_{model_name}_{button}", args=[quote(target.pk)])
        return client.post(url, {"post": "yes", **BUTTON_FORMS.get(action, {})})
    # Confirmed, as the "Yes" of the action's confirmation page posts it (without it nothing changes).
    return client.post(changelist, {"action": action, "_selected_action": [target.pk], "post": "yes"})


def admin_state():
    return {**state(), "tokens": list(Token.objects.order_by("pk").values())}


ADMIN_MATRIX = sorted(ADMIN_ACTIONS)


@pytest.mark.django_db
@pytest.mark.parametrize(("label", "action"), ADMIN_MATRIX, ids=[f"{label} {action}" for label, action in ADMIN_MATRIX])
def test_admin_action(client, label, action):
    world = AdminWorld()
    permission = ADMIN_ACTIONS[(label, action)]
    view = ADMIN_VIEW[label]
    target = world.target(label, action)
    everything_else = [p for p in _all_permissions() if p != permission]
    callers = [
        ("anonymous", None),
        ("non-staff holding the permission", UserFactory(permissions=[view, permission])),
        ("staff lacking the permission", UserFactory(is_staff=True, permissions=everything_else)),
        ("staff with no permission", UserFactory(is_staff=True)),
    ]
    for caller, user in callers:
        client.logout()
        if user is not None:
            client.force_login(user)
        before = admin_state()
        response = admin_request(client, label, action, target)
        if user is None or not user.is_staff:
            assert response.status_code == 302 and "/admin/login/" in response["Location"], caller
        elif action.startswith("button:") or action in ("add", "delete"):
            assert response.status_code == 403, f"{caller}: {response.status_code}"
        else:  # a list action the user may not run is not offered: the list again (or 403 to one who may not see it)
            assert response.status_code in (200, 302, 403), f"{caller}: {response.status_code}"
        assert admin_state() == before, f"{caller} changed something"

    client.logout()
    client.force_login(UserFactory(is_staff=True, permissions=[view, permission]))
    before = admin_state()
    response = admin_request(client, label, action, target)
    assert response.status_code in (200, 302), response.status_code
    assert admin_state() != before, "the permitted operator changed nothing"


# --- the one check itself ------------------------------------------------------------------------------


class Undeclared(APIView):
    """A view that forgot to say what it needs."""

    def get(self, request):
        return Response({"served": True})


class Declared(APIView):
    operator_permissions = {"GET": "queue.view_job"}

    def get(self, request):
        return Response({"served": True})


@pytest.mark.django_db
def test_a_method_without_a_declared_permission_is_refused_even_to_a_superuser():
    factory = APIRequestFactory()
    superuser = UserFactory(is_superuser=True)

    request = factory.get("/api/new-endpoint")
    force_authenticate(request, user=superuser)
    refused = Undeclared.as_view()(request)
    request = factory.post("/api/new-endpoint")
    force_authenticate(request, user=superuser)
    not_served = Declared.as_view()(request)

    assert refused.status_code == 403
    assert refused.data["code"] == "permission_denied"
    assert "declares no permission" in refused.data["detail"]
    assert not_served.status_code == 405  # a method the view does not serve is left to say so
