"""A download resumed with a Range request (`simpletuner jobs download`): 206 with the bytes asked for, 416 past the
end, the whole file for anything else."""

import hashlib

import pytest

from artifacts.models import Artifact
from artifacts.tests.support import downloaded
from artifacts.tests.test_uploads import put, running_job
from workers.tests.factories import UserFactory

pytestmark = pytest.mark.django_db

DATA = bytes(range(256)) * 40  # 10,240 bytes


@pytest.fixture
def download(bearer_client):
    job, _, token = running_job()
    assert put(token, "out/model.bin", DATA).status_code == 201
    artifact = Artifact.objects.get()
    client = bearer_client(UserFactory(permissions=["artifacts.download_artifact"]))
    return lambda **headers: client.get(f"/api/artifacts/{artifact.pk}/download", headers=headers)


def test_the_whole_file_says_it_takes_ranges(download):
    response = download()
    assert response.status_code == 200
    assert response["Accept-Ranges"] == "bytes" and response["Content-Length"] == str(len(DATA))
    assert downloaded(response) == DATA


def test_a_range_from_a_byte_on_answers_the_rest(download):
    response = download(Range="bytes=4000-")
    assert response.status_code == 206
    assert response["Content-Range"] == f"bytes 4000-{len(DATA) - 1}/{len(DATA)}"
    assert response["Content-Length"] == str(len(DATA) - 4000)
    assert response["X-Checksum-SHA256"] == hashlib.sha256(DATA).hexdigest()  # the whole file's, to check the result
    assert downloaded(response) == DATA[4000:]


def test_a_closed_range_answers_those_bytes_only(download):
    response = download(Range="bytes=10-19")
    assert (response.status_code, response["Content-Range"]) == (206, f"bytes 10-19/{len(DATA)}")
    assert downloaded(response) == DATA[10:20]
    past = download(Range=f"bytes=10240-99999")
    assert past.status_code == 416 and past["Content-Range"] == f"bytes */{len(DATA)}"
    assert past.json()["code"] == "range_not_satisfiable"


@pytest.mark.parametrize("header", ["bytes=-100", "bytes=5-2", "bytes=0-1,5-6", "items=0-", "bytes=x-"])
def test_a_range_of_another_shape_gets_the_whole_file(download, header):
    response = download(Range=header)
    assert response.status_code == 200 and downloaded(response) == DATA


def test_if_range_naming_another_file_gets_the_whole_file(download):
    changed = download(Range="bytes=100-", **{"If-Range": '"' + "0" * 64 + '"'})
    assert changed.status_code == 200 and downloaded(changed) == DATA
    same = download(Range="bytes=100-", **{"If-Range": '"' + hashlib.sha256(DATA).hexdigest() + '"'})
    assert same.status_code == 206 and downloaded(same) == DATA[100:]
