"""Issue 34, item 9: bidi overrides and other format controls (Unicode category Cf) in names and labels.

An operator's choice (a worker's name, its labels, a config's name) holding one is refused with a 400 (a
form error in the admin); what the upstream agent reports (its GPU, host and agent names) must not be
refused, so it is stored as sent and shown with its format controls escaped on the admin and by list_workers.
"""

from io import StringIO

import pytest
from django.core.management import call_command

from audit import actions
from common.inputs import format_controls_shown, name_problem
from job_queue.models import Job
from training_configs.models import TrainingConfig
from workers.models import Worker
from workers.tests.factories import UserFactory, WorkerFactory
from workers.tests.support import admin_url, audit_rows

pytestmark = pytest.mark.django_db

RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: "evil<RLO>exe.sh" reads "evilhs.exe"
FORMAT_CONTROLS = [RLO, "\u2066", "\u200b", "\u00ad", "\ufeff", "\U000e0041"]  # isolate, zero width, soft hyphen, BOM, tag


@pytest.mark.parametrize("char", FORMAT_CONTROLS)
def test_a_name_with_a_format_control_has_a_problem_and_is_shown_escaped(char):
    assert "format character" in name_problem(f"evil{char}exe.sh")
    shown = format_controls_shown(f"evil{char}exe.sh")
    assert char not in shown and shown.startswith(("evil\\u", "evil\\U"))
    assert name_problem("gpu-box-1 ünïcode ✓") is None  # letters and symbols stay allowed
    assert format_controls_shown("plain ✓") == "plain ✓"


@pytest.mark.parametrize("char", FORMAT_CONTROLS)
def test_the_api_refuses_a_worker_name_with_a_format_control(operator_client, char):
    response = operator_client.post("/api/admin/workers", {"name": f"evil{char}exe.sh"}, format="json")

    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_name"
    assert "format character" in response.json()["detail"]
    assert not Worker.objects.exists()
    assert audit_rows(actions.WORKER_CREATED) == []


def test_the_admin_add_form_refuses_a_worker_name_with_a_format_control(admin_client):
    response = admin_client.post("/admin/workers/worker/add/", {"name": f"evil{RLO}exe.sh", "worker_type": "persistent", "labels": ""})

    assert response.status_code == 200
    assert "format character" in str(response.context["form"].errors)
    assert not Worker.objects.exists()


@pytest.mark.parametrize("labels", [{f"gpu{RLO}": "a100"}, {"gpu": f"a100{RLO}"}, {"gpu": "a\u200b100"}])
def test_labels_with_a_format_control_are_refused(operator_client, labels):
    response = operator_client.post("/api/admin/workers", {"name": "gpu-box", "labels": labels}, format="json")

    assert response.status_code == 400, response.content
    assert not Worker.objects.exists()


def test_a_stored_config_name_with_a_format_control_is_refused(bearer_client):
    client = bearer_client(UserFactory(groups=["operator"]))

    response = client.post("/api/configs", {"name": f"flux{RLO}lora", "config": {}}, format="json")

    assert response.status_code == 400, response.content
    assert not TrainingConfig.objects.exists()


def test_a_submitted_config_name_with_a_format_control_is_refused(bearer_client):
    client = bearer_client(UserFactory(groups=["operator"]))

    response = client.post("/api/queue/submit", {"config_name": f"flux{RLO}lora", "config": {}}, format="json")

    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_config_name"
    assert "U+202E" in response.json()["detail"]
    assert not Job.objects.exists()


REPORTED = {"gpu_name": f"A100{RLO}XSS", "hostname": f"node{RLO}1", "name": f"agent{RLO}x", "agent_version": f"1.0{RLO}",
            "accelerator_type": f"cu{RLO}da", "gpu_count": 1}


def test_what_the_agent_reports_is_taken_and_shown_escaped_on_the_admin(worker_client, admin_client):
    worker = WorkerFactory(fresh=True)

    response = worker_client(worker).post("/api/workers/register", REPORTED, format="json")

    assert response.status_code == 200, response.content  # never refused: the upstream agent would stop
    worker.refresh_from_db()
    assert (worker.gpu_name, worker.hostname, worker.agent_name) == (REPORTED["gpu_name"], REPORTED["hostname"], REPORTED["name"])
    for page in (admin_url(worker), "/admin/workers/worker/"):
        html = admin_client.get(page).content.decode()
        assert RLO not in html, page
    html = admin_client.get(admin_url(worker)).content.decode()
    for shown in ("A100\\u202eXSS", "node\\u202e1", "agent\\u202ex", "1.0\\u202e", "cu\\u202eda"):
        assert shown in html


def test_list_workers_shows_what_the_agent_reports_escaped():
    WorkerFactory(name="gpu-box", gpu_count=1, gpu_name=f"A100{RLO}XSS")
    out = StringIO()

    call_command("list_workers", stdout=out)

    assert RLO not in out.getvalue()
    assert "1 × A100\\u202eXSS" in out.getvalue()
