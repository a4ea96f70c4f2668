"""Checkpoints leave the node as the trainer finishes them (the watcher), and a job whose last checkpoint is its
final step is not trained again."""

import hashlib
import json
import os
import sys
import textwrap
import threading
import time

import requests

from worker_agent import protocol
from worker_agent.artifacts import ArtifactTransfer
from worker_agent.checkpoints import CheckpointWatcher, final_step, reaches_final_step, result_from_checkpoint
from worker_agent.runner import JobRun

from .fakes import FakeResponse


class Store:
    """The orchestrator's artifact endpoints as the agent sees them: every request recorded, answered by
    ``answer(method, url)`` (default: stored / declared)."""

    def __init__(self, answer=None):
        self.calls = []
        self.answer = answer
        self.lock = threading.Lock()

    def request(self, method, url, data=None, headers=None, **kwargs):
        body = data.read() if hasattr(data, "read") else data
        with self.lock:
            self.calls.append({"method": method, "url": url, "headers": dict(headers or {}), "body": body})
        answer = self.answer(method, url) if self.answer else None
        if isinstance(answer, BaseException):
            raise answer
        if answer is not None:
            return answer
        if method == "PUT":
            return FakeResponse(201, {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)})
        return FakeResponse(200, {"complete": True})

    def keys(self, method="PUT"):
        prefix = "http://orch:8001" + protocol.UPLOAD_PATH + "/"
        return [c["url"].removeprefix(prefix) for c in self.calls if c["method"] == method]

    def declared(self):
        return [int(c["url"].split("/")[-2]) for c in self.calls if c["method"] == "POST"]


def transfer_to(store):
    return ArtifactTransfer(
        base_url="http://orch:8001", upload_endpoint=protocol.UPLOAD_PATH, token="stu_t", session=store, sleep=lambda s: None
    )


def write_checkpoint(output, step, *, guard="complete\n", files=None):
    directory = output / f"checkpoint-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in (files or {"pytorch_lora_weights.safetensors": b"w%d" % step, "optimizer.bin": b"o%d" % step}).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    if guard is not None:
        (directory / ".guard").write_text(guard)
    return directory


def watcher(tmp_path, store, **kwargs):
    return CheckpointWatcher(
        job_id="j_1", output_dir=tmp_path / "output", transfer=transfer_to(store), manifest_path=tmp_path / "uploaded.json", **kwargs
    )


def test_a_checkpoint_marked_complete_is_uploaded_once_whole_marker_last_then_declared(tmp_path):
    output = tmp_path / "output"
    write_checkpoint(output, 2, guard=None)  # still being written
    write_checkpoint(output, 4, guard="writing\n")  # a marker that does not say complete
    store = Store()
    watch = watcher(tmp_path, store)

    watch.scan()
    assert store.calls == []

    write_checkpoint(output, 2)  # the trainer wrote its marker, last
    watch.scan()
    watch.scan()  # looked at again: not sent twice

    assert store.keys() == [
        "output/checkpoint-2/optimizer.bin",
        "output/checkpoint-2/pytorch_lora_weights.safetensors",
        "output/checkpoint-2/.guard",
    ]
    assert all(c["headers"][protocol.CHECKPOINT_DECLARES_HEADER] == "1" for c in store.calls if c["method"] == "PUT")
    assert store.declared() == [2] and store.calls[-1]["url"] == "http://orch:8001" + protocol.checkpoint_complete_path(2)
    assert watch.uploaded == [2]
    recorded = json.loads((tmp_path / "uploaded.json").read_text())  # the end-of-run upload skips them
    assert {"checkpoint-2/.guard", "checkpoint-2/optimizer.bin", "checkpoint-2/pytorch_lora_weights.safetensors"} <= set(recorded)


def test_checkpoints_finished_before_it_started_are_not_sent_unless_rewritten(tmp_path):
    output = tmp_path / "output"
    resumed = write_checkpoint(output, 4)  # downloaded to resume from
    store = Store()
    watch = watcher(tmp_path, store)
    watch.scan()
    assert store.calls == []

    guard = resumed / ".guard"
    before = guard.stat().st_mtime_ns
    guard.write_text("complete\n")  # rewritten by the trainer: a new marker
    os.utime(guard, ns=(before + 10**9, before + 10**9))  # a later mtime whatever the file system's granularity
    write_checkpoint(output, 6)
    watch.scan()
    assert store.declared() == [4, 6]


def test_a_transient_failure_is_tried_again_later_and_a_refusal_is_not(tmp_path):
    output = tmp_path / "output"
    now = [0.0]
    failing = {"down": True}

    def answer(method, url):
        if "checkpoint-2" in url and failing["down"]:
            return requests.ConnectionError("refused")
        if "checkpoint-4" in url and method == "PUT":
            return FakeResponse(413, {"code": protocol.QUOTA_EXCEEDED, "detail": "quota"})
        return None

    store = Store(answer)
    watch = watcher(tmp_path, store, clock=lambda: now[0])
    write_checkpoint(output, 2)
    write_checkpoint(output, 4)
    watch.scan()  # checkpoint-2 unreachable after the transfer's own tries: this look ends there
    assert store.declared() == [] and len(store.calls) == 4
    watch.scan()  # not due yet
    assert len(store.calls) == 4

    failing["down"] = False
    now[0] += 120
    watch.scan()
    assert store.declared() == [2]  # checkpoint-4 refused (413): given up, not declared
    refused = len(store.calls)
    now[0] += 120
    watch.scan()
    assert len(store.calls) == refused and watch.uploaded == [2]


def test_a_dead_token_ends_the_watching(tmp_path):
    output = tmp_path / "output"
    store = Store(lambda method, url: FakeResponse(409, {"code": protocol.STALE_ATTEMPT, "detail": "gone"}))
    watch = watcher(tmp_path, store)
    write_checkpoint(output, 2)
    watch.scan()
    write_checkpoint(output, 4)
    watch.scan()
    assert len(store.calls) == 1


def test_stop_takes_a_last_look(tmp_path):
    store = Store()
    watch = watcher(tmp_path, store, interval=30).start()
    write_checkpoint(tmp_path / "output", 6)
    watch.stop()
    assert store.declared() == [6]


def test_the_final_step_and_the_weights_of_a_checkpoint(tmp_path):
    assert final_step({"--max_train_steps": 6}) == 6 and final_step({"max_train_steps": "6"}) == 6
    assert final_step({"max_train_steps": 0}) is None and final_step({"max_train_steps": True}) is None
    assert final_step({"num_train_epochs": 3}) is None and final_step({"max_train_steps": 2.5}) is None
    assert reaches_final_step({"max_train_steps": 6}, 6) and not reaches_final_step({"max_train_steps": 6}, 4)
    checkpoint = write_checkpoint(
        tmp_path / "output",
        6,
        files={"pytorch_lora_weights.safetensors": b"lora", "unet/diffusion_pytorch_model.safetensors": b"unet",
               "optimizer.bin": b"opt", "random_states_0.pkl": b"rng", "training_state.json": b"{}"},
    )  # fmt: skip
    assert result_from_checkpoint(checkpoint, tmp_path / "output") == [
        "pytorch_lora_weights.safetensors",
        "unet/diffusion_pytorch_model.safetensors",
    ]
    assert (tmp_path / "output" / "pytorch_lora_weights.safetensors").read_bytes() == b"lora"
    assert not (tmp_path / "output" / "optimizer.bin").exists()


# --- in a job run ---------------------------------------------------------------------------------


def make_run(tmp_path, store, script, *, config, resume=None):
    done = threading.Event()
    code = tmp_path / "trainer.py"
    code.write_text(textwrap.dedent(script))
    run = JobRun(
        job_id="j_1", attempt="a_1", config=config, dataloader=None, work_dir=tmp_path / "jobs",
        command=[sys.executable, str(code)], on_exit=lambda finished: done.set(), grace=5.0,
        transfer=transfer_to(store), resume=resume,
    )  # fmt: skip
    return run, done


TRAINER = """
    import json, os, pathlib, time
    out = pathlib.Path(json.load(open(os.environ["CONFIG_PATH"]))["output_dir"])
    for step in (2, 4):
        directory = out / f"checkpoint-{step}"
        directory.mkdir(parents=True)
        (directory / "pytorch_lora_weights.safetensors").write_bytes(b"w%d" % step)
        (directory / ".guard").write_text("complete\\n")
        print(f"saved checkpoint-{step}", flush=True)
        time.sleep(1.0 if step == 2 else 0)
    (out / "pytorch_lora_weights.safetensors").write_bytes(b"final")
"""


def test_a_run_uploads_each_finished_checkpoint_while_the_trainer_runs(tmp_path):
    store = Store()
    run, done = make_run(tmp_path, store, TRAINER, config={"max_train_steps": 4})
    run.start()

    deadline = time.monotonic() + 10
    while 2 not in store.declared():  # while the trainer sleeps after checkpoint-2
        assert time.monotonic() < deadline and not done.is_set(), store.calls
        time.sleep(0.02)
    assert done.wait(10) and run.returncode == 0

    assert store.declared() == [2, 4]
    keys = store.keys()
    assert keys.count("output/checkpoint-2/pytorch_lora_weights.safetensors") == 1  # not again at the end
    assert keys[-1] == "output/pytorch_lora_weights.safetensors"  # the end-of-run upload: the rest


def test_a_job_resumed_at_its_final_step_runs_no_trainer_and_ends_with_the_checkpoints_weights(tmp_path):
    weights = b"the weights of step 6"
    files = [
        {"key": "output/checkpoint-6/pytorch_lora_weights.safetensors", "data": weights},
        {"key": "output/checkpoint-6/optimizer.bin", "data": b"opt"},
        {"key": "output/checkpoint-6/.guard", "data": b"complete\n"},
    ]
    resume = {
        "step": 6, "checkpoint": "checkpoint-6", "attempt": 1,
        "files": [{"key": f["key"], "size": len(f["data"]), "sha256": hashlib.sha256(f["data"]).hexdigest(),
                   "download_url": f"{protocol.UPLOAD_PATH}/{f['key']}"} for f in files],
    }  # fmt: skip
    bodies = {protocol.UPLOAD_PATH + "/" + f["key"]: f["data"] for f in files}

    class Download(FakeResponse):
        def __init__(self, data):
            super().__init__(200)
            self.data = data

        def iter_content(self, size):
            yield self.data

    def answer(method, url):
        path = url.removeprefix("http://orch:8001")
        return Download(bodies[path]) if method == "GET" else None

    store = Store(answer)
    run, done = make_run(tmp_path, store, "raise SystemExit('the trainer must not run')", config={"--max_train_steps": 6}, resume=resume)
    run.start()

    assert done.wait(10)
    assert run.process is None and run.returncode == 0 and run.stop_reason is None
    assert store.keys() == ["output/pytorch_lora_weights.safetensors"]  # the checkpoint itself is stored already
    assert store.calls[-1]["body"] == weights
    progress, _ = run.snapshot()
    assert (progress["step"], progress["total_steps"], progress["fraction"]) == (6, 6, 1.0)
    assert "checkpoint-6 is this run's final step" in run.log_tail()
    run.stop("cancel")  # nothing to signal
    run.kill()
