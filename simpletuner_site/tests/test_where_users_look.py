"""Addresses a user tries first (issue 32.9): /api/docs/ signed out leads to the sign-in page and back, and
the configs API answers under /api/configs/ as the other APIs do with a trailing slash."""

import pytest
from django.test import Client

from audit.services import Actor
from training_configs.services import config_create
from workers.tests.factories import UserFactory

pytestmark = pytest.mark.django_db


BROWSER = {"HTTP_ACCEPT": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


def test_the_api_docs_signed_out_send_a_browser_to_sign_in_and_back():
    client = Client()

    response = client.get("/api/docs/", **BROWSER)

    assert response.status_code == 302
    assert response["Location"] == "/api-auth/login/?next=/api/docs/"
    sign_in = client.get(response["Location"])
    assert sign_in.status_code == 200 and b'name="password"' in sign_in.content
    reader = UserFactory(username="reader")
    reader.set_password("a-long-password-1")
    reader.save()
    back = client.post(response["Location"], {"username": "reader", "password": "a-long-password-1", "next": "/api/docs/"})
    assert back.status_code == 302 and back["Location"] == "/api/docs/"
    assert client.get("/api/docs/", **BROWSER).status_code == 200


def test_the_api_docs_signed_out_are_a_401_to_other_clients_and_to_a_bad_token(api_client):
    assert api_client.get("/api/docs/", HTTP_ACCEPT="*/*").status_code == 401  # curl's
    response = api_client.get("/api/docs/", HTTP_AUTHORIZATION="Bearer sta_not-a-token", **BROWSER)
    assert response.status_code == 401


def test_the_configs_api_answers_with_and_without_the_trailing_slash(operator_client):
    config_create(name="sdxl-base", config={"learning_rate": 1e-4}, actor=Actor.system("test"))

    for path in ("/api/configs", "/api/configs/"):
        response = operator_client.get(path)
        assert response.status_code == 200, path
        assert [c["name"] for c in response.json()["results"]] == ["sdxl-base"]
    for path in ("/api/configs/sdxl-base", "/api/configs/sdxl-base/"):
        response = operator_client.get(path)
        assert response.status_code == 200, path
        assert response.json()["name"] == "sdxl-base"
    created = operator_client.post("/api/configs/", {"name": "second", "config": {"lr": 1}}, format="json")
    assert created.status_code == 201, created.content
    assert operator_client.get("/api/configs/nothing-here/").status_code == 404
