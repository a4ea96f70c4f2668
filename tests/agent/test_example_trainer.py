"""The example trainer: its maths in process, and the real program as the agent runs it (a subprocess)."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from worker_agent import example_trainer as trainer
from worker_agent.progress import parse_line

REPO = Path(__file__).resolve().parents[2]


def write_config(directory, config):
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(config))
    return path


def trainer_env(config_path):
    env = {key: value for key, value in os.environ.items() if key != "CONFIG_PATH"}
    if config_path is not None:
        env["CONFIG_PATH"] = str(config_path)
    return env


def run_trainer(config_path, timeout=30):
    return subprocess.run(
        [sys.executable, "-m", "worker_agent.example_trainer"],
        cwd=REPO,
        env=trainer_env(config_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def progress_updates(stdout):
    return [update for update in map(parse_line, stdout.splitlines()) if update is not None]


def test_a_run_completes_learns_and_leaves_a_checkpoint(tmp_path):
    result = run_trainer(write_config(tmp_path, {"max_train_steps": 100}))

    assert result.returncode == 0, result.stderr
    assert "training complete" in result.stdout
    assert result.stderr == ""
    updates = progress_updates(result.stdout)
    assert [u["step"] for u in updates] == list(range(101))  # step 0, then every step
    assert all(u["total_steps"] == 100 for u in updates)
    assert updates[-1]["fraction"] == 1.0
    losses = [u["loss"] for u in updates]
    assert losses[-1] < 0.5 * losses[0]
    assert sum(losses[-10:]) < sum(losses[1:11])  # it keeps improving, not just one lucky step
    assert updates[-1]["metrics"]["accuracy"] > 0.85 > updates[0]["metrics"]["accuracy"]
    assert "step 40/100 loss " in result.stdout  # the plain log line
    for step in (25, 50, 75):
        assert f"checkpoint saved at step {step}" in result.stdout

    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    assert checkpoint["step"] == 100
    assert checkpoint["complete"] is True
    assert checkpoint["seed"] == 42
    assert checkpoint["loss"] == losses[-1]
    assert len(checkpoint["weights"]) == 3
    # SimpleTuner's layout: a checkpoint-<step> directory every checkpoint_every steps, no temp files
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-25", "checkpoint-50", "checkpoint-75", "checkpoint.json", "config.json",
    ]  # fmt: skip
    assert json.loads((tmp_path / "checkpoint-50" / "checkpoint.json").read_text())["step"] == 50


def test_dashed_keys_string_numbers_and_output_dir(tmp_path):
    output_dir = tmp_path / "out" / "nested"
    config = {"--max_train_steps": "20", "--seed": 7, "--learning_rate": "0.5", "output_dir": str(output_dir)}
    result = run_trainer(write_config(tmp_path, config))

    assert result.returncode == 0, result.stderr
    checkpoint = json.loads((output_dir / "checkpoint.json").read_text())
    assert (checkpoint["step"], checkpoint["seed"], checkpoint["learning_rate"]) == (20, 7, 0.5)
    assert not (tmp_path / "checkpoint.json").exists()
    assert progress_updates(result.stdout)[-1]["step"] == 20


def test_fail_at_step_exits_3_with_the_error_on_stderr(tmp_path):
    result = run_trainer(write_config(tmp_path, {"max_train_steps": 50, "fail_at_step": 5}))

    assert result.returncode == 3
    assert "simulated failure at step 5" in result.stderr
    assert progress_updates(result.stdout)[-1]["step"] == 4
    assert "training complete" not in result.stdout
    assert not (tmp_path / "checkpoint.json").exists()


def read_lines(stream, lines):
    for text in stream:
        lines.put(text)
    lines.put(None)


@pytest.mark.parametrize(
    "signum, code, step_delay, wait_for_step",
    [
        (signal.SIGTERM, 143, 0.05, 3),
        (signal.SIGINT, 130, 0.05, 3),
        (signal.SIGTERM, 143, 30, 1),  # the signal cuts a long step_delay short
    ],
    ids=["sigterm", "sigint", "sigterm-during-a-long-delay"],
)
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, signum, code, step_delay, wait_for_step):
    config_path = write_config(tmp_path, {"max_train_steps": 10_000, "step_delay": step_delay})
    process = subprocess.Popen(
        [sys.executable, "-m", "worker_agent.example_trainer"],
        cwd=REPO,
        env=trainer_env(config_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    output = []
    try:
        deadline = time.monotonic() + 10
        while True:
            text = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert text is not None, "".join(output)
            output.append(text)
            update = parse_line(text)
            if update and update.get("step", 0) >= wait_for_step:
                break
        sent = time.monotonic()
        process.send_signal(signum)
        returncode = process.wait(timeout=10)
        elapsed = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    while (text := lines.get(timeout=5)) is not None:
        output.append(text)
    stdout = "".join(output)

    assert returncode == code, stdout
    assert elapsed < 10.0  # prompt, and a third of the 30 s step_delay it must cut short (load-tolerant)
    stopped = [text for text in output if text.startswith("stopped by signal at step ")]
    assert len(stopped) == 1, stdout
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert stopped[0].rstrip("\n").endswith("; checkpoint saved")
    assert wait_for_step <= step < 10_000
    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    assert checkpoint["step"] == step
    assert checkpoint["complete"] is False
    assert progress_updates(stdout)[-1]["step"] == step


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda tmp: None, "CONFIG_PATH is not set"),
        (lambda tmp: tmp / "missing.json", "cannot read config"),
        (lambda tmp: write_config(tmp, []), "must be a JSON object"),
        (lambda tmp: write_config(tmp, {"learning_rate": "fast"}), "learning_rate must be a number"),
        (lambda tmp: write_config(tmp, {"max_train_steps": 2.5}), "max_train_steps must be an integer"),
        (lambda tmp: write_config(tmp, {"train_batch_size": 0}), "train_batch_size must be at least 1"),
    ],
    ids=["unset", "missing-file", "not-an-object", "bad-number", "not-an-integer", "out-of-range"],
)
def test_an_unusable_config_exits_2_with_one_line(tmp_path, setup, message):
    result = run_trainer(setup(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert message in result.stderr
    assert result.stderr.startswith("example_trainer: ")


def test_unparsable_json_exits_2(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"max_train_steps": ')
    result = run_trainer(path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert "cannot read config" in result.stderr


def test_the_agent_modules_import_nothing_outside_the_standard_library_and_the_agent_dependencies():
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import worker_agent.gpu, worker_agent.progress, worker_agent.example_trainer\n"
        "worker_agent.gpu.GpuMonitor().close()\n"
        "allowed = set(sys.stdlib_module_names) | {'worker_agent', 'pynvml', 'psutil', 'requests'}\n"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - allowed))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# The maths, in process.


def test_the_gradient_matches_finite_differences():
    batch = trainer.make_dataset(seed=3)[:16]
    weights = [0.3, -0.2, 0.1]
    analytic = trainer.gradient(weights, batch)
    h = 1e-6
    for i in range(3):
        up = list(weights)
        down = list(weights)
        up[i] += h
        down[i] -= h
        numeric = (trainer.loss_and_accuracy(up, batch)[0] - trainer.loss_and_accuracy(down, batch)[0]) / (2 * h)
        assert analytic[i] == pytest.approx(numeric, rel=1e-4, abs=1e-8)


def test_an_sgd_step_lowers_the_loss_on_its_batch():
    batch = trainer.make_dataset(seed=5)[:32]
    weights = trainer.init_weights(5)
    before = trainer.loss_and_accuracy(weights, batch)[0]
    after = trainer.loss_and_accuracy(trainer.sgd_step(weights, batch, 0.1), batch)[0]
    assert after < before - 1e-3


def test_the_loss_is_stable_for_extreme_logits():
    point = [(1000.0, 1000.0, 1), (1000.0, 1000.0, 0)]
    loss, accuracy = trainer.loss_and_accuracy([1.0, 1.0, 0.0], point)
    assert loss == pytest.approx(1000.0)  # the wrong point costs its logit (2000), the right one ~0
    assert accuracy == 0.5
    assert trainer.sigmoid(-1000.0) == 0.0 and trainer.sigmoid(1000.0) == 1.0


def test_the_dataset_is_seeded_and_balanced():
    points = trainer.make_dataset(seed=1)
    assert points == trainer.make_dataset(seed=1)
    assert points != trainer.make_dataset(seed=2)
    assert len(points) == trainer.DATASET_SIZE
    assert sum(label for _, _, label in points) == trainer.DATASET_SIZE // 2


def test_batches_cover_each_epoch_once():
    points = trainer.make_dataset(seed=1, size=10)
    batches = trainer.iterate_batches(points, 4, seed=1)
    first_epoch = [next(batches) for _ in range(3)]
    assert [epoch for epoch, _ in first_epoch] == [1, 1, 1]
    assert [len(batch) for _, batch in first_epoch] == [4, 4, 2]
    assert sorted(p for _, batch in first_epoch for p in batch) == sorted(points)
    assert next(batches)[0] == 2


def run_in_process(directory, **overrides):
    config = trainer.parse_config({"max_train_steps": 40, **overrides})
    assert trainer.train(config, str(directory), trainer.StopRequest()) == 0
    return json.loads((Path(directory) / "checkpoint.json").read_text())


def test_same_seed_same_result_and_another_seed_differs(tmp_path, capsys):
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for directory in runs:
        directory.mkdir()
    first = run_in_process(runs[0], seed=11)
    second = run_in_process(runs[1], seed=11)
    other = run_in_process(runs[2], seed=12)
    assert first == second
    assert other["loss"] != first["loss"] and other["weights"] != first["weights"]
    assert capsys.readouterr().out.count("training complete") == 3


def test_parse_config_defaults_and_dashed_keys():
    assert trainer.parse_config({"unrelated": "ignored", "--seed": None}) == {
        "max_train_steps": 100,
        "learning_rate": 0.1,
        "seed": 42,
        "train_batch_size": 32,
        "checkpoint_every": 25,
        "step_delay": 0.0,
        "fail_at_step": None,
        "output_dir": None,
        "resume_from_checkpoint": None,
    }
    config = trainer.parse_config({"--train_batch_size": "8", "step_delay": 0.5, "--fail_at_step": 3})
    assert (config["train_batch_size"], config["step_delay"], config["fail_at_step"]) == (8, 0.5, 3)
    for bad in ({"learning_rate": 0}, {"seed": True}, {"step_delay": -1}, {"output_dir": 5}, {"learning_rate": "inf"}):
        with pytest.raises(trainer.ConfigError):
            trainer.parse_config(bad)


def test_write_checkpoint_replaces_the_old_one_and_leaves_no_temporary(tmp_path):
    trainer.write_checkpoint(str(tmp_path), {"step": 1})
    path = trainer.write_checkpoint(str(tmp_path), {"step": 2})
    assert path == str(tmp_path / "checkpoint.json")
    assert json.loads(Path(path).read_text()) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, capsys):
    """Resuming from checkpoint-20 replays the same batches from step 20: the same final weights."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    expected = run_in_process(whole, checkpoint_every=20)
    config = trainer.parse_config({"max_train_steps": 40, "checkpoint_every": 20, "resume_from_checkpoint": "checkpoint-20"})
    (cut / "checkpoint-20").mkdir()
    (cut / "checkpoint-20" / "checkpoint.json").write_text((whole / "checkpoint-20" / "checkpoint.json").read_text())

    assert trainer.train(config, str(cut), trainer.StopRequest(), trainer.load_resume(config, str(cut))) == 0

    resumed = json.loads((cut / "checkpoint.json").read_text())
    assert (resumed["step"], resumed["weights"], resumed["loss"]) == (40, expected["weights"], expected["loss"])
    assert "resumed from checkpoint-20 at step 20" in capsys.readouterr().out


def test_resuming_from_a_missing_checkpoint_is_a_config_error(tmp_path):
    result = run_trainer(write_config(tmp_path, {"max_train_steps": 5, "resume_from_checkpoint": "checkpoint-9"}))
    assert result.returncode == 2 and "cannot resume" in result.stderr


class FakeResponse:
    status = 201

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_step_checkpoints_are_published_and_declared_complete(tmp_path):
    sent = []

    def opener(request, timeout):
        sent.append((request.get_method(), request.full_url, request.get_header("X-upload-token"), request.data))
        return FakeResponse()

    publisher = trainer.Publisher("http://orch:8001/api/cloud/storage", "stu_token", opener=opener, sleep=lambda s: None)
    config = trainer.parse_config({"max_train_steps": 20, "checkpoint_every": 10})

    assert trainer.train(config, str(tmp_path), trainer.StopRequest(), None, publisher) == 0

    assert [(m, u, t) for m, u, t, _ in sent] == [
        ("PUT", "http://orch:8001/api/cloud/storage/output/checkpoint-10/checkpoint.json", "stu_token"),
        ("POST", "http://orch:8001/api/cloud/checkpoints/10/complete", "stu_token"),
    ]
    assert json.loads(sent[0][3])["step"] == 10
