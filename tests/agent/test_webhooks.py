"""The trainer's webhooks: the agent's receiver, what SimpleTuner's real events mean, and the job's webhook_config."""

import json
import logging
import socket
from pathlib import Path

import pytest
import requests

from worker_agent import webhooks
from worker_agent.output import Output
from worker_agent.webhooks import KEY_HEADER, MAX_EVENT_BYTES, WebhookReceiver, interpret, with_entry

# Posted by SimpleTuner's own trainer to a raw webhook (see its "_source").
EVENTS = json.loads((Path(__file__).parent / "simpletuner_events.json").read_text())


def fold(events, output=None):
    output = output or Output()
    moved = [output.event(event) for event in events]
    return output, [stage for stage in moved if stage]


# --- what SimpleTuner's events mean ------------------------------------------------------------------


def test_a_real_run_gives_step_total_percent_loss_learning_rate_eta_and_epoch():
    output, _ = fold(EVENTS["run"][:31])  # up to the second step's status
    progress = output.progress
    assert (progress["step"], progress["total_steps"]) == (2, 6)
    assert progress["fraction"] == pytest.approx(2 / 6)
    assert progress["loss"] == pytest.approx(1.2789678573608398)
    assert progress["learning_rate"] == pytest.approx(0.0001)
    assert progress["epoch"] == 1
    assert progress["eta_seconds"] == pytest.approx(0.5711221320000277)
    assert progress["stage"] == {"key": "training", "label": "Training", "status": "running"}
    # the other numeric metrics stay as metrics; the promoted and the redundant ones do not repeat there
    assert progress["metrics"]["iteration_step_time_seconds"] == pytest.approx(0.14278053300000693)
    assert not {"loss", "learning_rate", "epoch", "total_batch_size", "effective_batch_size"} & set(progress["metrics"])


def test_a_whole_real_run_ends_at_its_last_step_in_the_stage_training_complete():
    output, moved = fold(EVENTS["run"])
    progress = output.progress
    assert (progress["step"], progress["total_steps"], progress["fraction"]) == (6, 6, 1.0)
    assert progress["loss"] == pytest.approx(1.0546059608459473)  # not the 0.0 of the completion stage's metrics
    assert progress["stage"]["key"] == "training_complete" and progress["stage"]["status"] == "completed"
    assert progress["stage"]["label"] == "Training Complete"
    assert output.error is None and output.last_line() == ""  # the agent's stage lines never sum up a failure
    keys = [(stage["key"], stage["status"]) for stage in moved]
    assert keys[:3] == [("init_data_backend", "running"), ("init_text_embed_cache", "running"), ("init_text_embed_cache", "completed")]
    assert keys.count(("checkpoint_save", "running")) == keys.count(("checkpoint_save", "completed")) == 3
    assert keys[-1] == ("training_complete", "completed")


def test_stage_changes_are_lines_of_the_log_but_progress_within_a_stage_is_not():
    output, _ = fold(EVENTS["run"][:19])
    lines = output.log_tail(200).splitlines()
    assert lines[0] == "[stage] Configuring data backends: running - Configuring data backends... (this may take a while!)"
    assert "[stage] Text Embedding Caching in Progress: running" in lines
    assert sum("Text Embedding Caching" in line for line in lines) == 1  # 8 events, one stage, one status
    assert lines[-1] == "[stage] Configuring data backends: completed - Completed configuring data backends."
    # a stage's label is kept through the updates that leave it out
    output, _ = fold(EVENTS["run"][:11])
    assert output.progress["stage"] == {
        "key": "init_cache_text_embeds_status_update",
        "label": "Text Embedding Caching in Progress",
        "status": "running",
        "current": 2,
        "total": 6,
        "percent": 33.0,
    }
    # ... and the stage lines are never a failure's summary
    assert output.last_line() == ""


def test_the_trainers_own_error_event_is_the_summary():
    output, moved = fold(EVENTS["failure"])
    assert output.last_line() == (
        "Training failed: OSError: We couldn't connect to 'https://huggingface.co' to load this model, couldn't find it in "
        "the cached files and it looks like /tmp/h5/tinyfail/nomodel is not the path to a directory containing a "
        "scheduler_config.json file."
    )
    assert output.progress["stage"] == {"key": "training", "label": "Training", "status": "failed"}
    assert moved == [output.progress["stage"]]


def test_the_trainers_failure_events_from_its_run_loop_give_their_message():
    output, _ = fold(EVENTS["trainer_failure"])
    assert output.last_line() == "Training failed: CUDA out of memory. Tried to allocate 2.00 GiB"
    # its `error` event, when it follows, says more (the exception's type) and wins
    fold(EVENTS["failure"][1:2], output)
    assert output.last_line().startswith("Training failed: OSError: We couldn't connect")
    # a later, lesser error does not replace it
    fold(EVENTS["trainer_failure"], output)
    assert output.last_line().startswith("Training failed: OSError")


@pytest.mark.parametrize(
    "event",
    [
        None,
        [],
        "text",
        {},
        {"type": "log.message", "severity": "error", "message": "logged already on stdout"},
        {"type": "training.status", "data": "x", "progress": ["x"]},
        {"type": "training.status", "progress": {"current": "2", "total": None, "percent": float("nan"), "metrics": {"loss": "high"}}},
        {"type": "lifecycle.stage", "stage": "x"},
        {"type": "lifecycle.stage", "stage": {"progress": {"current": -1}}},
        {"type": "notification", "severity": "error", "message": "\x1b[0m", "title": ""},
        {"type": "training.checkpoint", "checkpoint": {"path": "/x/checkpoint-2"}},
    ],
)
def test_events_that_mean_nothing_change_nothing_and_never_raise(event):
    output = Output()
    assert output.event(event) is None
    assert (output.progress, output.error, output.version) == ({}, None, 0)


def test_interpret_reads_percent_alone_and_the_status_outside_data():
    meaning = interpret({"type": "training.status", "progress": {"percent": 40}})
    assert meaning.update["fraction"] == 0.4
    meaning = interpret({"status": "failed", "type": "training.status", "severity": "error"})
    assert meaning.error == "training failed" and meaning.update["stage"]["status"] == "failed"
    meaning = interpret({"type": "gpu.fault", "severity": "critical", "message": "GPU 0 fell off the bus", "title": "GPU Fault: xid"})
    assert meaning.error == "GPU 0 fell off the bus"


# --- the job's webhook_config ------------------------------------------------------------------------

OURS = {"webhook_type": "raw", "callback_url": "http://127.0.0.1:1/x", "auth_token": "s"}
USERS = {"webhook_type": "discord", "webhook_url": "https://discord.example/hook"}


@pytest.mark.parametrize(
    "existing, merged",
    [
        (None, [OURS]),
        ("", [OURS]),
        (USERS, [USERS, OURS]),
        ([USERS, USERS], [USERS, USERS, OURS]),
        (json.dumps(USERS), [USERS, OURS]),
        (json.dumps([USERS]), [USERS, OURS]),
        ("{not json", None),
        ("missing.json", None),
        (5, None),
    ],
)
def test_our_entry_joins_the_users_webhooks(tmp_path, existing, merged):
    assert with_entry(existing, OURS, tmp_path) == merged


def test_an_entry_an_agent_added_for_another_job_is_dropped(tmp_path):
    stale = {"webhook_type": "raw", "callback_url": "http://127.0.0.1:40000/simpletuner-agent/old", "auth_token": "old"}
    users_raw = {"webhook_type": "raw", "callback_url": "http://127.0.0.1:8080/my-dashboard"}
    assert with_entry([USERS, stale, users_raw], OURS, tmp_path) == [USERS, users_raw, OURS]
    assert with_entry(stale, OURS, tmp_path) == [OURS]


def test_a_webhook_config_file_is_read_relative_to_the_job_directory(tmp_path):
    (tmp_path / "hooks.json").write_text(json.dumps(USERS))
    assert with_entry("hooks.json", OURS, tmp_path) == [USERS, OURS]
    assert with_entry(str(tmp_path / "hooks.json"), OURS, "/elsewhere") == [USERS, OURS]


# --- the receiver -------------------------------------------------------------------------------------


@pytest.fixture
def receiver():
    received = []
    receiver = WebhookReceiver(received.append).start()
    receiver.received = received
    yield receiver
    receiver.stop()


def post(url, body, *, key=None, **kwargs):
    headers = {"Content-Type": "application/json", **({KEY_HEADER: key} if key is not None else {})}
    return requests.post(url, data=body if isinstance(body, bytes) else json.dumps(body), headers=headers, timeout=5, **kwargs)


def test_the_receiver_takes_the_trainers_posts_and_listens_on_loopback_only(receiver):
    assert receiver._server.server_address[0] == "127.0.0.1"
    entry = receiver.config_entry()
    assert entry["webhook_type"] == "raw" and entry["callback_url"].startswith("http://127.0.0.1:")
    event = EVENTS["run"][29]
    answer = post(entry["callback_url"], event, key=entry["auth_token"])
    assert answer.status_code == 204
    assert receiver.received == [event]


def test_a_forged_post_is_refused_before_its_body_is_read(receiver):
    url = receiver.url
    base = url[: url.index(webhooks.PATH_PREFIX)]
    forged = [
        (url, None),  # the path but no key
        (url, "guess"),  # the path and a wrong key
        (base + webhooks.PATH_PREFIX + "guess", receiver.secret),  # the key on another path
        (base + "/", receiver.secret),
        (url + "/x", receiver.secret),
    ]
    for target, key in forged:
        answer = post(target, {"type": "training.status", "progress": {"current": 5, "total": 6}}, key=key)
        assert answer.status_code == 403, (target, key)
    assert receiver.received == []
    assert post(url, {"type": "notification"}, key=receiver.secret).status_code == 204  # and it still serves


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[1, 2]", b"7", b"", b"[" * 100_000])
def test_a_malformed_body_is_answered_400_and_the_receiver_goes_on(receiver, body):
    assert post(receiver.url, body, key=receiver.secret).status_code == 400
    assert post(receiver.url, {"type": "notification"}, key=receiver.secret).status_code == 204
    assert receiver.received == [{"type": "notification"}]


def test_an_oversized_post_is_read_and_dropped_and_a_request_without_length_is_refused(receiver):
    huge = json.dumps({"type": "validation", "images": ["x" * (MAX_EVENT_BYTES + 10)]}).encode()
    assert post(receiver.url, huge, key=receiver.secret).status_code == 204
    port = receiver._server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        path = receiver.url[receiver.url.index(webhooks.PATH_PREFIX) :]
        raw.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{KEY_HEADER}: {receiver.secret}\r\n\r\n".encode())
        assert raw.recv(100).startswith(b"HTTP/1.0 411")
    assert receiver.received == []
    assert requests.get(receiver.url, timeout=5).status_code == 501


def test_a_failing_handler_is_logged_and_the_receiver_goes_on(caplog):
    def explode(payload):
        raise RuntimeError("bug")

    receiver = WebhookReceiver(explode).start()
    try:
        with caplog.at_level(logging.ERROR, logger="worker_agent.webhooks"):
            assert post(receiver.url, {"type": "x"}, key=receiver.secret).status_code == 204
            assert post(receiver.url, {"type": "x"}, key=receiver.secret).status_code == 204
        assert caplog.text.count("a trainer event could not be handled") == 2
        assert receiver.secret not in caplog.text
    finally:
        receiver.stop()
