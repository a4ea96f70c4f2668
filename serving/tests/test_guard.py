"""The rules a request's head is judged by before its body is read (``serving.guard``); served end to end in
``tests/e2e/test_body_guard.py``."""

import pytest

from artifacts.tokens import upload_token
from serving.guard import SPOOL, Spool, body_limit, judge_head, route_path
from worker_agent import protocol

MiB = 1024 * 1024


def headers(**values):
    given = {name.replace("_", "-").lower().encode(): value.encode() for name, value in values.items()}
    return lambda name: given.get(name.lower())


def test_a_request_without_a_body_is_left_to_the_view():
    assert judge_head(protocol.HEARTBEAT_PATH, headers(), None, False) == (0, None)
    assert judge_head(protocol.HEARTBEAT_PATH, headers(), 0, False) == (0, None)


def test_a_route_gets_its_limit(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "MAX_REQUEST_BYTES": MiB, "ARTIFACT_MAX_BYTES": 5 * MiB}
    assert body_limit("/api/queue/submit") == body_limit("/admin/login/") == MiB
    assert body_limit(f"{protocol.UPLOAD_PATH}/b/k") == 5 * MiB
    assert judge_head("/api/queue/submit", headers(), MiB + 1, False)[1].status == 413
    assert judge_head("/api/queue/submit", headers(), MiB, False) == (MiB, None)


def test_a_worker_route_with_a_body_needs_the_worker_token_header():
    limit, refusal = judge_head(protocol.HEARTBEAT_PATH, headers(), None, True)
    assert (limit, refusal.status, refusal.code) == (None, 401, protocol.NOT_AUTHENTICATED)
    assert judge_head(protocol.HEARTBEAT_PATH, headers(X_Worker_Token="wt_x"), 10, False)[1] is None


@pytest.mark.django_db
def test_an_upload_needs_a_token_this_orchestrator_signed():
    path = f"{protocol.UPLOAD_PATH}/bucket/model.bin"
    signed = upload_token("lease-1")
    assert judge_head(path, headers(), 10, False)[1].status == 401
    assert judge_head(path, headers(X_Upload_Token="stu_forged"), 10, False)[1].status == 401
    assert judge_head(path, headers(X_Upload_Token=signed), 10, False)[1] is None
    assert judge_head(path, headers(X_SimpleTuner_Secret=signed), 10, False)[1] is None


def test_the_path_is_judged_as_daphne_gives_it_to_the_application():
    assert route_path(b"/api/cloud%2Fstorage/b/k?x=/api/workers/") == "/api/cloud/storage/b/k"


def test_the_spool_bound_holds_across_requests(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "SPOOL_MAX_BYTES": 3 * MiB}
    spool = Spool()
    assert spool.take(2 * MiB) is None
    refusal = spool.take(2 * MiB)
    assert (refusal.status, refusal.retry_after, spool.held) == (503, 5, 2 * MiB)
    spool.give_back(2 * MiB)
    assert spool.take(3 * MiB) is None
    assert SPOOL.held == 0  # the server's own holds nothing outside a server


def test_a_refusal_is_a_whole_json_answer_that_closes_the_connection():
    _, refusal = judge_head(protocol.HEARTBEAT_PATH, headers(), None, True)
    head, _, body = refusal.response().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 Unauthorized\r\n") and b"\r\nConnection: close" in head
    assert b'"code": "not_authenticated"' in body and f"Content-Length: {len(body)}".encode() in head
