"""What an operator downloads (issue 32.9): a job's ``download_url`` is absolute like its ``url``, and each
artifact downloads under a name of its own (its whole key), so a job's checkpoints, whose files share their
base names, do not overwrite each other."""

import pytest

from artifacts.models import Artifact
from artifacts.storage import download_name
from artifacts.tests.support import downloaded
from artifacts.tests.test_uploads import put, running_job
from workers.tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_download_urls_are_absolute_and_each_file_has_its_own_name(bearer_client):
    job, _, token = running_job()
    for step in (50, 100):
        assert put(token, f"output/checkpoint-{step}/state.json", f"step {step}".encode()).status_code == 201
    operator = bearer_client(UserFactory(permissions=["queue.view_job", "artifacts.download_artifact"]))

    detail = operator.get(f"/api/queue/{job.pk}").json()

    assert detail["url"].startswith("http://testserver/api/queue/")
    by_key = {artifact["key"]: artifact for artifact in detail["artifacts"]}
    names = {}
    for step in (50, 100):
        artifact = by_key[f"output/checkpoint-{step}/state.json"]
        stored = Artifact.objects.get(job_id=job.pk, key=artifact["key"])
        assert artifact["download_url"] == f"http://testserver/api/artifacts/{stored.pk}/download"
        response = operator.get(artifact["download_url"])
        assert response.status_code == 200 and downloaded(response) == f"step {step}".encode()
        names[step] = response["Content-Disposition"]
    assert names == {
        50: 'attachment; filename="output_checkpoint-50_state.json"',
        100: 'attachment; filename="output_checkpoint-100_state.json"',
    }


@pytest.mark.parametrize(
    "key, name",
    [("model.bin", "model.bin"), ("out/final/model.bin", "out_final_model.bin"), ("a//b/", "a_b")],
)
def test_download_name(key, name):
    assert download_name(key) == name
