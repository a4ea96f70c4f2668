"""Issue 34, item 11: secrets in configs are shown masked to readers without ``configs.view_config_secrets``.

Stored configs and jobs' configs alike, in the API and the admin; the shipped admin group holds the
permission, viewers and operators do not; the agent still receives every value (the job_submit event
and the worker API are untouched).
"""

import json

import pytest

from audit.services import Actor
from job_queue.models import Job
from job_queue.services import job_submit
from training_configs.models import TrainingConfig
from training_configs.secrets import MASK, config_shown, config_unmasked, secret_key
from training_configs.services import config_create
from workers.tests.factories import UserFactory, WorkerFactory
from workers.tests.support import admin_url, sent_events

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")
CONFIG = {
    "learning_rate": 0.0001,
    "hf_token": "hf_SECRETHF",
    "report_to": {"WANDB_API_KEY": "wandb-SECRETWB", "project": "flux"},
    "webhooks": [{"url": "https://example.com/hook", "auth_password": "SECRETPW"}],
    "tokenizer_max_length": 77,  # "*token*": a key the default patterns mask too
}
LOADER = [{"id": "s3-pics", "type": "aws", "aws_secret_access_key": "SECRETAWS", "aws_bucket_name": "pics"}]
SECRETS = ("hf_SECRETHF", "wandb-SECRETWB", "SECRETPW", "SECRETAWS")
MASKED_CONFIG = {
    "learning_rate": 0.0001,
    "hf_token": MASK,
    "report_to": {"WANDB_API_KEY": MASK, "project": "flux"},
    "webhooks": [{"url": "https://example.com/hook", "auth_password": MASK}],
    "tokenizer_max_length": MASK,
}
MASKED_LOADER = [{"id": "s3-pics", "type": "aws", "aws_secret_access_key": MASK, "aws_bucket_name": "pics"}]


def _client(bearer_client, group):
    return bearer_client(UserFactory(groups=[group]))


# --- the rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["hf_token", "HF_TOKEN", "aws_secret_access_key", "db_Password", "api_key", "KEY"])
def test_the_default_patterns_make_a_key_secret_whatever_its_case(key):
    assert secret_key(key)


@pytest.mark.parametrize("key", ["learning_rate", "model_family", "output_dir", "pass"])
def test_other_keys_are_not_secret(key):
    assert not secret_key(key)


def test_masking_reaches_every_depth_and_leaves_the_value_alone():
    assert config_shown(CONFIG, reveal=False) == MASKED_CONFIG
    assert config_shown(LOADER, reveal=False) == MASKED_LOADER
    assert config_shown(CONFIG, reveal=True) is CONFIG
    assert CONFIG["hf_token"] == "hf_SECRETHF"


def test_a_secret_left_masked_takes_its_stored_value_back_and_a_new_one_is_kept():
    edited = {**MASKED_CONFIG, "learning_rate": 0.5, "hub_token": "hf_NEW"}

    assert config_unmasked(edited, CONFIG) == {**CONFIG, "learning_rate": 0.5, "hub_token": "hf_NEW"}
    assert config_unmasked({"hf_token": MASK}, {}) == {"hf_token": MASK}  # nothing stored to take back


def test_the_patterns_are_a_setting(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "SECRET_CONFIG_KEYS": ("*cred*",)}

    assert config_shown({"hf_token": "t", "my_CREDS": "c"}, reveal=False) == {"hf_token": "t", "my_CREDS": MASK}


# --- the API -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", ["viewer", "operator"])
def test_a_stored_config_is_masked_for_viewers_and_operators(bearer_client, group):
    config_create(name="flux-lora", config=CONFIG, dataloader=LOADER, actor=ACTOR)

    response = _client(bearer_client, group).get("/api/configs/flux-lora")

    assert response.status_code == 200
    (version,) = response.json()["versions"]
    assert (version["config"], version["dataloader"]) == (MASKED_CONFIG, MASKED_LOADER)
    assert not any(secret in response.content.decode() for secret in SECRETS)


def test_the_admin_group_reads_a_stored_configs_secrets(bearer_client):
    config_create(name="flux-lora", config=CONFIG, dataloader=LOADER, actor=ACTOR)

    (version,) = _client(bearer_client, "admin").get("/api/configs/flux-lora").json()["versions"]

    assert (version["config"], version["dataloader"]) == (CONFIG, LOADER)


def test_storing_a_config_answers_it_masked_and_stores_it_whole(bearer_client):
    response = _client(bearer_client, "operator").post("/api/configs", {"name": "flux-lora", "config": CONFIG}, format="json")

    assert response.status_code == 201
    assert response.json()["config"] == MASKED_CONFIG
    assert TrainingConfig.objects.get().config == CONFIG


@pytest.mark.parametrize("group", ["viewer", "operator"])
def test_a_jobs_config_is_masked_in_its_page_the_list_and_the_submit_answer(bearer_client, group, commit):
    client = _client(bearer_client, group)
    job, _ = job_submit(config_name="adhoc", config=CONFIG, dataloader=LOADER, actor=ACTOR)

    detail = client.get(f"/api/queue/{job.pk}")
    listed = client.get("/api/queue/")

    assert (detail.json()["config"], detail.json()["dataloader"]) == (MASKED_CONFIG, MASKED_LOADER)
    assert listed.json()["results"][0]["config"] == MASKED_CONFIG
    for response in (detail, listed):
        assert not any(secret in response.content.decode() for secret in SECRETS)
    if group == "operator":
        submitted = client.post("/api/queue/submit", {"config_name": "adhoc", "config": CONFIG}, format="json")
        assert submitted.status_code == 201 and submitted.json()["config"] == MASKED_CONFIG


def test_the_admin_group_reads_a_jobs_secrets(bearer_client):
    job, _ = job_submit(config_name="adhoc", config=CONFIG, dataloader=LOADER, actor=ACTOR)

    detail = _client(bearer_client, "admin").get(f"/api/queue/{job.pk}").json()

    assert (detail["config"], detail["dataloader"]) == (CONFIG, LOADER)


def test_the_agent_receives_every_secret(commit):
    worker = WorkerFactory()
    config_create(name="flux-lora", config=CONFIG, dataloader=LOADER, actor=ACTOR)
    with commit():
        job, dispatched = job_submit(config_name="flux-lora", actor=ACTOR)

    assert dispatched
    (event,) = [e for e in sent_events(worker.pk) if e["type"] == "job_submit"]
    assert (event["data"]["config"], event["data"]["dataloader"]) == (CONFIG, LOADER)
    assert Job.objects.get(pk=job.pk).config == CONFIG


# --- the admin -----------------------------------------------------------------------------------------


def _page(client, url):
    response = client.get(url)
    assert response.status_code == 200
    return response.content.decode()


def test_a_jobs_admin_page_masks_secrets_unless_the_user_may_view_them(staff_client, client):
    job, _ = job_submit(config_name="adhoc", config=CONFIG, dataloader=LOADER, actor=ACTOR)

    masked = _page(staff_client("queue.view_job"), admin_url(job))
    client.force_login(UserFactory(is_staff=True, permissions=["queue.view_job", "configs.view_config_secrets"]))
    revealed = _page(client, admin_url(job))

    assert MASK in masked and not any(secret in masked for secret in SECRETS)
    assert all(secret in revealed for secret in SECRETS)


def test_a_stored_configs_admin_page_masks_its_body_and_diff_for_a_viewer(staff_client):
    first = config_create(name="flux-lora", config=CONFIG, actor=ACTOR)
    second = config_create(name="flux-lora", config={**CONFIG, "hf_token": "hf_SECRETTWO"}, dataloader=LOADER, actor=ACTOR)

    page = _page(staff_client("configs.view_trainingconfig"), admin_url(second))

    assert MASK in page
    assert not any(secret in page for secret in (*SECRETS, "hf_SECRETTWO"))
    assert "version 1" in page  # the diff is there, masked on both sides
    assert first.config == CONFIG


def test_an_operator_edits_a_config_without_seeing_or_losing_its_secrets(client):
    stored = config_create(name="flux-lora", config=CONFIG, dataloader=LOADER, actor=ACTOR)
    client.force_login(UserFactory(is_staff=True, groups=["operator"]))
    url = admin_url(stored)

    form = client.get(url).context["adminform"].form
    assert json.loads(form["config"].value()) == MASKED_CONFIG
    assert not any(secret in client.get(url).content.decode() for secret in SECRETS)

    edited = {**MASKED_CONFIG, "learning_rate": 0.5, "hub_token": "hf_NEW"}
    response = client.post(url, {"config": json.dumps(edited), "dataloader": json.dumps(MASKED_LOADER), "description": "lr"})

    assert response.status_code == 302, response.context["adminform"].form.errors if response.context else response
    stored.refresh_from_db()
    assert stored.config == {**CONFIG, "learning_rate": 0.5, "hub_token": "hf_NEW"}
    assert stored.dataloader == LOADER


def test_the_admin_group_sees_and_edits_secrets_in_the_clear(client):
    stored = config_create(name="flux-lora", config=CONFIG, actor=ACTOR)
    client.force_login(UserFactory(is_staff=True, groups=["admin"]))

    form = client.get(admin_url(stored)).context["adminform"].form

    assert json.loads(form["config"].value()) == CONFIG
