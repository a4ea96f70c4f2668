"""Stored configs: versions, resolution at submit, immutability once used, the API and the admin."""

import pytest

from audit import actions
from audit.services import Actor
from job_queue.models import Job
from job_queue.services import job_submit
from training_configs.models import TrainingConfig
from training_configs.services import config_create, config_edit
from workers.tests.factories import UserFactory
from workers.tests.support import admin_url, audit_rows

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")
BASE = {"model_family": "flux", "learning_rate": 0.0001, "max_train_steps": 100}
LOADER = [{"id": "pics", "type": "local"}]


@pytest.fixture
def configs_client(bearer_client):
    return bearer_client(UserFactory(groups=["operator"]))


def test_posting_a_name_again_makes_its_next_version(configs_client):
    first = configs_client.post("/api/configs", {"name": "flux-lora", "config": BASE, "dataloader": LOADER, "description": "v1"})
    second = configs_client.post("/api/configs", {"name": "flux-lora", "config": {**BASE, "max_train_steps": 200}})

    assert (first.status_code, first.json()["version"], second.status_code, second.json()["version"]) == (201, 1, 201, 2)
    listed = configs_client.get("/api/configs").json()["results"]
    assert [(c["name"], c["version"]) for c in listed] == [("flux-lora", 2)]
    detail = configs_client.get("/api/configs/flux-lora").json()
    assert detail["latest"] == 2 and [v["version"] for v in detail["versions"]] == [2, 1]
    assert detail["versions"][1]["dataloader"] == LOADER and detail["versions"][1]["description"] == "v1"
    assert detail["versions"][0]["owner"] is not None
    assert [r.details["version"] for r in audit_rows(actions.CONFIG_CREATED)] == [1, 2]
    assert configs_client.get("/api/configs/nope").status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"name": "a@b", "config": {}},
        {"name": "a/b", "config": {}},
        {"name": "tab\there", "config": {}},
        {"name": " padded", "config": {}},
        {"name": "naïve", "config": {}},  # printable ASCII only: what the OpenAPI schema declares
        {"name": "ok", "config": [1]},
        {"name": "ok", "config": {}, "dataloader": "x"},
        {"config": {}},
    ],
)
def test_a_bad_config_is_a_400(configs_client, body):
    response = configs_client.post("/api/configs", body, format="json")
    assert response.status_code == 400, response.content
    assert not TrainingConfig.objects.exists()


def test_a_200_character_name_is_stored_and_audited_by_the_config_id(configs_client):
    """The audit row's target id is at most 64 characters (PostgreSQL refused the name there: a 500)."""
    response = configs_client.post("/api/configs", {"name": "n" * 200, "config": BASE}, format="json")

    assert response.status_code == 201, response.content
    (row,) = audit_rows(actions.CONFIG_CREATED)
    assert row.target_id == str(TrainingConfig.objects.get().pk) and row.details["name"] == "n" * 200


def test_submit_by_name_runs_the_latest_version_with_inline_keys_over_it():
    config_create(name="flux-lora", config=BASE, dataloader=LOADER, actor=ACTOR)
    v2 = config_create(name="flux-lora", config={**BASE, "max_train_steps": 200}, dataloader=LOADER, actor=ACTOR)

    job, _ = job_submit(config_name="flux-lora", config={"learning_rate": 0.5, "seed": 3}, actor=ACTOR)

    assert job.training_config == v2 and job.config_name == "flux-lora"
    assert job.config == {**BASE, "max_train_steps": 200, "learning_rate": 0.5, "seed": 3}
    assert job.dataloader == LOADER
    v2.refresh_from_db()
    assert v2.immutable


def test_submit_by_name_at_version_and_refusals():
    config_create(name="flux-lora", config=BASE, actor=ACTOR)
    config_create(name="flux-lora", config={**BASE, "max_train_steps": 200}, actor=ACTOR)

    job, _ = job_submit(config_name="flux-lora@1", dataloader=[{"id": "mine"}], actor=ACTOR)
    assert (job.training_config.version, job.config["max_train_steps"], job.dataloader) == (1, 100, [{"id": "mine"}])

    from common.errors import InvalidInput

    with pytest.raises(InvalidInput, match="has no version 9 .it has 1, 2."):
        job_submit(config_name="flux-lora@9", actor=ACTOR)
    with pytest.raises(InvalidInput, match="whole number"):
        job_submit(config_name="flux-lora@latest", actor=ACTOR)


def test_an_unknown_name_is_accepted_as_not_stored_unless_a_setting_refuses_it(queue_client, settings):
    config_create(name="flux-lora", config=BASE, actor=ACTOR)
    accepted = queue_client.post("/api/queue/submit", {"config_name": "adhoc", "config": {"x": 1}})
    assert accepted.status_code == 201
    assert (accepted.json()["config_stored"], accepted.json()["config_version"], accepted.json()["config"]) == (False, None, {"x": 1})

    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "REQUIRE_STORED_CONFIG": True}
    refused = queue_client.post("/api/queue/submit", {"config_name": "adhoc"})
    stored = queue_client.post("/api/queue/submit", {"config_name": "flux-lora"})

    assert refused.status_code == 400
    assert refused.json()["code"] == "config_not_stored" and refused.json()["stored_configs"] == ["flux-lora"]
    assert "flux-lora" in refused.json()["detail"]
    assert stored.status_code == 201 and stored.json()["config_version"] == 1
    assert Job.objects.count() == 2


def test_a_used_version_is_immutable_editing_makes_the_next_one():
    draft = config_create(name="sdxl", config={"a": 1}, actor=ACTOR)
    same, new = config_edit(config_id=draft.pk, config={"a": 2}, dataloader=None, description="tuned", actor=ACTOR)
    assert (same.pk, new, same.config) == (draft.pk, False, {"a": 2})  # unused: changed in place

    job_submit(config_name="sdxl", actor=ACTOR)
    successor, new = config_edit(config_id=draft.pk, config={"a": 3}, dataloader=None, description="", actor=ACTOR)

    assert new and successor.version == 2 and successor.config == {"a": 3}
    assert TrainingConfig.objects.get(pk=draft.pk).config == {"a": 2}  # the version the job ran is kept


def test_a_retry_runs_the_same_stored_version(queue_client):
    from job_queue.models import JobStatus

    v1 = config_create(name="sdxl", config={"a": 1}, actor=ACTOR)
    job, _ = job_submit(config_name="sdxl", actor=ACTOR)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.FAILED)
    config_create(name="sdxl", config={"a": 2}, actor=ACTOR)

    response = queue_client.post(f"/api/queue/{job.pk}/retry")

    assert response.status_code == 201 and response.json()["config_version"] == 1
    assert Job.objects.get(pk=response.json()["id"]).training_config == v1


# --- the admin ---------------------------------------------------------------------------------------


def test_the_admin_checks_json_and_saving_a_used_version_makes_the_next(staff_client):
    client = staff_client("configs.view_trainingconfig", "configs.add_trainingconfig", "configs.change_trainingconfig")

    bad = client.post("/admin/configs/trainingconfig/add/", {"name": "sdxl", "config": "{not json", "dataloader": ""})
    not_object = client.post("/admin/configs/trainingconfig/add/", {"name": "sdxl", "config": "[1, 2]", "dataloader": ""})
    assert bad.status_code == not_object.status_code == 200 and not TrainingConfig.objects.exists()
    assert b"must be a JSON object" in not_object.content

    added = client.post("/admin/configs/trainingconfig/add/", {"name": "sdxl", "config": '{"lr": 1}', "dataloader": "", "description": ""})
    assert added.status_code == 302
    v1 = TrainingConfig.objects.get()
    job_submit(config_name="sdxl", actor=ACTOR)

    changed = client.post(
        f"/admin/configs/trainingconfig/{v1.pk}/change/", {"config": '{"lr": 2, "steps": 5}', "dataloader": "", "description": "more"}
    )

    assert changed.status_code == 302
    assert [(c.version, c.config) for c in TrainingConfig.objects.order_by("version")] == [(1, {"lr": 1}), (2, {"lr": 2, "steps": 5})]
    page = client.get(f"/admin/configs/trainingconfig/{TrainingConfig.objects.get(version=2).pk}/change/")
    assert b"version 1" in page.content and b"version 2" in page.content
    assert b"-    &quot;lr&quot;: 1" in page.content and b"+    &quot;lr&quot;: 2," in page.content


def test_the_job_page_links_its_stored_config_or_says_not_stored(staff_client):
    config_create(name="sdxl", config={"a": 1}, actor=ACTOR)
    stored, _ = job_submit(config_name="sdxl", actor=ACTOR)
    adhoc, _ = job_submit(config_name="adhoc", actor=ACTOR)
    client = staff_client("queue.view_job")

    assert b"sdxl@1" in client.get(admin_url(stored)).content
    assert b"config not stored" in client.get(admin_url(adhoc)).content
