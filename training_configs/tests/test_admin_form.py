"""Issue 34, item 8: the admin's config form holds JSON to the API's own rules, each refusal a form error, never a 500.

NaN, infinities, a number past a double (1e400), a NUL or an unpaired surrogate in a key or string, and nesting
past MAX_JSON_DEPTH (5,000 deep is past the decoder's own recursion limit) were stored or crashed the save.
"""

import pytest

from audit.services import Actor
from training_configs.models import TrainingConfig
from training_configs.services import config_create
from workers.tests.support import admin_url

pytestmark = pytest.mark.django_db

ADD = "/admin/configs/trainingconfig/add/"
EDITOR = ("configs.view_trainingconfig", "configs.add_trainingconfig", "configs.change_trainingconfig")
BAD_JSON = {
    "nan": '{"lr": NaN}',
    "infinity": '{"lr": Infinity}',
    "minus-infinity": '{"lr": [-Infinity]}',
    "1e400": '{"lr": 1e400}',
    "nul-in-string": '{"prompt": "a\\u0000b"}',
    "nul-in-key": '{"a\\u0000b": 1}',
    "unpaired-surrogate": '{"prompt": "\\ud800"}',
    "5000-deep": "[" * 5000 + "]" * 5000,
    "40-deep": '{"a": ' + "[" * 40 + "]" * 40 + "}",
}


@pytest.mark.parametrize("field", ["config", "dataloader"])
@pytest.mark.parametrize("bad", list(BAD_JSON.values()), ids=list(BAD_JSON))
def test_adding_a_config_with_json_the_api_refuses_is_a_form_error(staff_client, bad, field):
    body = {"name": "sdxl", "config": '{"lr": 1}', "dataloader": "", "description": "", field: bad}

    response = staff_client(*EDITOR).post(ADD, body)

    assert response.status_code == 200
    assert response.context["adminform"].form.errors, "no form error"
    assert not TrainingConfig.objects.exists()


@pytest.mark.parametrize("bad", list(BAD_JSON.values()), ids=list(BAD_JSON))
def test_editing_a_config_with_json_the_api_refuses_is_a_form_error_and_changes_nothing(staff_client, bad):
    stored = config_create(name="sdxl", config={"lr": 1}, actor=Actor.system("test"))

    response = staff_client(*EDITOR).post(admin_url(stored), {"config": bad, "dataloader": "", "description": "x"})

    assert response.status_code == 200
    assert "config" in response.context["adminform"].form.errors
    assert [(c.version, c.config, c.description) for c in TrainingConfig.objects.all()] == [(1, {"lr": 1}, "")]


def test_the_form_names_where_the_json_is_refused(staff_client):
    response = staff_client(*EDITOR).post(ADD, {"name": "sdxl", "config": '{"opt": {"lr": NaN}}', "dataloader": "", "description": ""})

    assert response.context["adminform"].form.errors["config"] == ["opt.lr: nan is not a number JSON can hold"]


def test_the_job_submit_form_shows_refused_json_again_as_typed(staff_client):
    response = staff_client("queue.view_job", "queue.submit_job").post(
        "/admin/queue/job/add/", {"config_name": "sdxl", "config": '{"prompt": "\\ud800"}', "priority": 0, "target": "worker"}
    )

    assert response.status_code == 200
    assert response.context["form"].errors["config"]
    assert '{&quot;prompt&quot;: &quot;\\ud800&quot;}' in response.content.decode()
