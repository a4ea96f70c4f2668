"""Every way a call to the orchestrator can fail, sorted into fatal, transient, refused or rejected."""

import threading

import pytest
import requests

from worker_agent.client import (
    HTTP_TIMEOUT,
    STOPPING_TIMEOUT,
    FatalError,
    OrchestratorClient,
    Refused,
    Rejected,
    TransientError,
)

from .fakes import FakeResponse, FakeSession, connection_refused

URL = "https://orch.example.com:8001"
TOKEN = "wt_secret_token_value"


def client(*script):
    return OrchestratorClient(URL + "/", TOKEN, session=FakeSession(*script))


def test_token_goes_in_the_header_and_every_call_has_a_timeout():
    c = client(FakeResponse(200, {"worker_id": "w_1"}), FakeResponse(200, {"status": "idle"}))
    assert c.register({"name": "n"}) == {"worker_id": "w_1"}
    c.heartbeat({"status": "idle"})
    session = c.session
    assert session.headers["X-Worker-Token"] == TOKEN
    assert all(call["timeout"] for call in session.calls)
    assert session.calls[0]["url"] == URL + "/api/workers/register"
    assert session.calls[1]["json"]["worker_id"] == "w_1"  # remembered from register


def test_401_is_fatal_with_the_fix_and_without_the_token():
    c = client(FakeResponse(401, {"code": "not_authenticated", "detail": "Invalid token"}))
    with pytest.raises(FatalError) as caught:
        c.register({})
    text = str(caught.value)
    assert "invalid token" in text and "rotated" in text and "whitespace" in text
    assert TOKEN not in text


def test_403_is_fatal():
    with pytest.raises(FatalError):
        client(FakeResponse(403, {"detail": "this token belongs to worker w_2"})).heartbeat({})


def test_409_is_refused_with_the_job_to_abandon():
    c = client(FakeResponse(409, {"code": "stale_attempt", "detail": "attempt a_1 is no longer current", "abandon_job": "j_9"}))
    with pytest.raises(Refused) as caught:
        c.report("j_9", {"status": "running"})
    assert (caught.value.code, caught.value.abandon_job) == ("stale_attempt", "j_9")


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_5xx_and_429_are_transient_and_honour_retry_after(status):
    c = client(FakeResponse(status, {"detail": "busy"}, headers={"Retry-After": "7"}))
    with pytest.raises(TransientError) as caught:
        c.heartbeat({})
    assert caught.value.retry_after == 7.0


def test_connection_refused_is_transient_with_the_troubleshooting_fix():
    with pytest.raises(TransientError) as caught:
        client(connection_refused()).register({})
    text = str(caught.value)
    assert "connection refused" in text and "--host 0.0.0.0" in text and "firewall" in text


def test_timeout_is_transient():
    with pytest.raises(TransientError):
        client(requests.exceptions.ReadTimeout("read timed out")).heartbeat({})


def test_certificate_failure_is_fatal_with_both_fixes():
    error = requests.exceptions.SSLError(
        "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate (_ssl.c:1006)"
    )
    with pytest.raises(FatalError) as caught:
        client(error).register({})
    text = str(caught.value)
    assert "certificate verify failed (self-signed certificate)" in text
    assert "--ssl-no-verify" in text and "--ca-cert" in text


def test_plain_http_port_with_https_url_is_explained():
    error = requests.exceptions.SSLError("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    with pytest.raises(FatalError) as caught:
        client(error).register({})
    assert "does not speak TLS" in str(caught.value)


def test_register_404_means_wrong_url():
    with pytest.raises(FatalError) as caught:
        client(FakeResponse(404, {"detail": "not found"})).register({})
    assert "no worker API" in str(caught.value)


def test_other_4xx_is_rejected():
    with pytest.raises(Rejected) as caught:
        client(FakeResponse(400, {"code": "invalid_status", "detail": "status must be one of"})).report("j", {})
    assert caught.value.status == 400


def test_stream_sends_last_event_id_and_uses_a_long_read_timeout():
    c = client(FakeResponse(200))
    c.worker_id = "w_1"
    c.open_stream(last_event_id="worker-w_1:4")
    call = c.session.calls[0]
    assert call["headers"]["Last-Event-ID"] == "worker-w_1:4"
    assert call["stream"] is True
    assert call["params"] == {"worker_id": "w_1"}
    assert call["timeout"][1] >= 60


@pytest.mark.parametrize("verify", ["/etc/ca.pem", False])
def test_verify_setting_goes_with_every_request(verify):
    # per request, because requests lets REQUESTS_CA_BUNDLE override a session-level setting
    c = OrchestratorClient(URL, TOKEN, verify=verify, session=FakeSession(FakeResponse(200, {}), FakeResponse(200)))
    c.heartbeat({})
    c.open_stream()
    assert [call["verify"] for call in c.session.calls] == [verify, verify]


def test_every_call_has_a_short_connect_and_a_bounded_read_timeout():
    c = client(FakeResponse(200, {"worker_id": "w_1"}), FakeResponse(200, {}), FakeResponse(200, {}))
    c.register({})
    c.report("j_1", {"status": "running"})
    c.disconnect()
    for call in c.session.calls:
        connect, read = call["timeout"]
        assert connect <= 5 and read <= 15


def test_once_stopping_calls_use_the_stopping_timeouts():
    c = client(FakeResponse(200, {}), FakeResponse(200, {}))
    c.heartbeat({})
    c.stopping()
    c.disconnect()
    assert c.session.calls[0]["timeout"] == HTTP_TIMEOUT
    assert c.session.calls[1]["timeout"] == STOPPING_TIMEOUT and sum(STOPPING_TIMEOUT) <= 5


def test_interrupt_breaks_the_blocked_call_into_a_transient_error():
    c = client()

    def blocked():
        c.interrupt()  # what the signal handler does while the main thread waits on the socket
        raise AssertionError("not interrupted")

    c.session.script.append(blocked)
    with pytest.raises(TransientError) as caught:
        c.heartbeat({})
    assert "interrupted" in str(caught.value)


def test_interrupt_outside_a_call_and_from_another_thread_does_nothing():
    c = client()
    c.interrupt()  # no call in flight: nothing raised
    seen = []

    def from_another_thread():
        worker = threading.Thread(target=lambda: seen.append(c.interrupt()))
        worker.start()
        worker.join()
        return FakeResponse(200, {"status": "idle"})

    c.session.script.append(from_another_thread)
    assert c.heartbeat({}) == {"status": "idle"} and seen == [None]


@pytest.mark.parametrize("failure", ["Connection reset by peer", "RemoteDisconnected('Remote end closed connection')"])
def test_a_connection_lost_after_the_orchestrator_answered_is_transient_never_a_wrong_scheme(monkeypatch, failure):
    """Once the orchestrator has answered over the URL, a reset (a proxy cut, a restart) says nothing of its
    scheme: no probe, and the agent goes on retrying instead of leaving with a fatal 'wrong scheme'."""
    import worker_agent.client

    probes = []
    monkeypatch.setattr(worker_agent.client, "speaks_plain_http", lambda *a, **k: probes.append(a) or True)
    c = client(FakeResponse(200, {"worker_id": "w_1"}), requests.exceptions.ConnectionError(failure))
    c.register({"name": "n"})

    with pytest.raises(TransientError):
        c.heartbeat({"status": "idle"})
    assert probes == []


def test_a_reset_before_any_answer_still_looks_for_a_wrong_scheme(monkeypatch):
    import worker_agent.client

    monkeypatch.setattr(worker_agent.client, "speaks_plain_http", lambda *a, **k: True)
    c = client(requests.exceptions.ConnectionError("Connection reset by peer"))

    with pytest.raises(FatalError) as caught:
        c.register({"name": "n"})
    assert "speaks plain HTTP, not HTTPS" in str(caught.value)


def test_interrupt_leaves_a_registration_in_flight_unless_forced():
    """The orchestrator may have registered the worker already: only the answer's worker id lets the agent
    disconnect it, so a first signal lets the call finish; a forced interrupt (the third signal) breaks it."""
    c = client()

    def signalled_mid_register():
        c.interrupt()  # not broken
        return FakeResponse(200, {"worker_id": "w_1"})

    c.session.script.append(signalled_mid_register)
    assert c.register({})["worker_id"] == "w_1" and c.worker_id == "w_1"

    def forced_mid_register():
        c.interrupt(force=True)
        raise AssertionError("not interrupted")

    c.session.script.append(forced_mid_register)
    with pytest.raises(TransientError, match="interrupted"):
        c.register({})
