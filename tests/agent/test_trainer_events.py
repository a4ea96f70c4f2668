"""Trainer output as text, its failure's summary, and a real trainer process posting its webhook events to the agent."""

import json
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from worker_agent.output import Output, read_log
from worker_agent.runner import JobRun, exit_report
from worker_agent.text import plain

EVENTS_FILE = Path(__file__).parent / "simpletuner_events.json"

# The end of SimpleTuner's trainer's output when it failed to load its model (bghira/SimpleTuner bc8e6ab, a
# sdxl LoRA config with a model path that is not there), as written to its log: every piece coloured, then
# reset, and the last line a bare colour reset.
SIMPLETUNER_CRASH = (
    b"\x1b[0mTraceback (most recent call last):\n"
    b'\x1b[0m\x1b[0m  File "/venv/lib/python3.11/site-packages/diffusers/configuration_utils.py", line 414, in load_config\n'
    b"\x1b[0m\x1b[0m    \x1b[0mconfig_file = hf_hub_download(\x1b[0m\n"
    b"\x1b[0m\x1b[0m \x1b[0m \x1b[0m \x1b[0m^\x1b[0m^\x1b[0m^\x1b[0m^\n"
    b"\x1b[0m\x1b[0mhuggingface_hub.errors\x1b[0m.\x1b[0mHFValidationError\x1b[0m: \x1b[0mRepo id must be in the form 'repo_name'\x1b[0m\n"
    b"\x1b[0m\x1b[0m\n"
    b"\x1b[0m\x1b[0mDuring handling of the above exception, another exception occurred:\n"
    b"\x1b[0m\x1b[0m\n"
    b"\x1b[0m\x1b[0mTraceback (most recent call last):\n"
    b'\x1b[0m\x1b[0m  File "/venv/src/simpletuner/train.py", line 281, in <module>\n'
    b"\x1b[0m\x1b[0m    \x1b[0mtrainer = Trainer(\x1b[0m\n"
    b"\x1b[0m\x1b[0mOSError\x1b[0m: \x1b[0mWe couldn't connect to 'https://huggingface.co' to load this model.\n"
    b"Checkout your internet connection or see how to run the library in offline mode.\x1b[0m\n"
    b"\x1b[0m"
)


@pytest.mark.parametrize(
    "raw, text",
    [
        ("\x1b[0m", ""),
        ("\x1b[1;31mred\x1b[0m and \x1b[38;5;196mmore\x1b[39m", "red and more"),
        ("\x1b[2K\x1b[Aup\x1b[?25l", "up"),
        ("\x1b]0;window title\x07shown", "shown"),
        ("\x1b]8;;https://example.org\x1b\\a link\x1b]8;;\x1b\\", "a link"),
        ("\x1bPdevice control\x1b\\after", "after"),
        ("\x1b(Bcharset \x1b7saved\x1b8", "charset saved"),
        ("\x9b31mC1 CSI", "C1 CSI"),
        ("bell\x07 back\x08space nul\x00 del\x7f tab\tkept", "bell backspace nul del tab\tkept"),
        ("cut at the end \x1b[", "cut at the end "),
        ("lone escape \x1b", "lone escape "),
        ("unicode stays: ✓ — Ω", "unicode stays: ✓ — Ω"),
    ],
)
def test_terminal_escapes_and_control_characters_are_removed(raw, text):
    assert plain(raw) == text


def output_of(data):
    output = Output()
    for line in data.split(b"\n"):
        output.add(line)
    return output


def test_a_coloured_crash_whose_last_line_is_a_colour_reset_sums_up_as_its_exception():
    output = output_of(SIMPLETUNER_CRASH)
    assert output.last_line() == "OSError: We couldn't connect to 'https://huggingface.co' to load this model."
    tail = output.log_tail(200)
    assert "\x1b" not in tail
    assert "" not in tail.splitlines()  # no blank line, no line that was only escapes
    assert tail.splitlines()[0] == "Traceback (most recent call last):"


def test_without_a_traceback_the_summary_is_the_last_line_that_says_something():
    output = output_of(b"loading\nstep 3: \x1b[31mloss is NaN\x1b[0m\n=====\n\x1b[0m\n\x07\n  \n")
    assert output.last_line() == "step 3: loss is NaN"
    assert output_of(b"\x1b[0m\n\x1b[2K\n").last_line() == ""
    # a traceback whose header scrolled out of the tail: the last line that says something
    assert output_of(b'  File "x.py", line 1\nValueError: bad\n').last_line() == "ValueError: bad"


def test_a_failed_trainer_whose_output_is_coloured_reports_its_exception(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            print("\\x1b[32mINFO\\x1b[0m loading the model")
            sys.stdout.write("\\x1b]0;training\\x07")
            try:
                raise RuntimeError("\\x1b[1mboom\\x1b[0m")
            except RuntimeError:
                import traceback
                sys.stdout.write("\\x1b[31m" + traceback.format_exc() + "\\x1b[0m")
            print("\\x1b[2mcleaning up\\x1b[0m")
            print("\\x1b[0m")
            sys.exit(1)
            """
        )
    )
    done = threading.Event()
    run = JobRun(
        job_id="j_1", attempt="a_1", config={}, dataloader=None, work_dir=tmp_path / "jobs",
        command=[sys.executable, str(script)], on_exit=lambda run: done.set(), grace=5,
    )  # fmt: skip
    run.start()
    assert done.wait(15)
    report = exit_report(run.attempt, run.returncode, None, progress={}, log_tail=run.log_tail(), last_line=run.last_line())
    assert report["status"] == "failed"
    assert report["error"] == "Training exited with code 1: RuntimeError: boom"
    assert "\x1b" not in report["log_tail"] and "\x07" not in report["log_tail"]
    assert report["log_tail"].splitlines()[-1] == "cleaning up"
    assert b"\x1b[0m" in (run.job_dir / "train.log").read_bytes()  # the file keeps what the trainer wrote


# A trainer that does what SimpleTuner's does with its config's webhook_config: posts each event, as JSON, to
# every raw entry's callback_url with its auth_token as X-API-Key (helpers/webhooks/handler.py), and waits
# for each answer.
WEBHOOK_TRAINER = """
import json, os, sys, urllib.request
config = json.load(open(os.environ["CONFIG_PATH"]))
hooks = config["--webhook_config"]
events = json.load(open(sys.argv[1]))[sys.argv[2]]
print("webhooks:", json.dumps([hook.get("webhook_type") for hook in hooks]))
for event in events:
    for hook in hooks:
        if hook.get("webhook_type") != "raw":
            continue
        request = urllib.request.Request(
            hook["callback_url"], data=json.dumps(event).encode(), method="POST",
            headers={"Content-Type": "application/json", "X-API-Key": hook.get("auth_token") or ""},
        )
        urllib.request.urlopen(request, timeout=5).read()
print("\\x1b[0m")
sys.exit(0 if sys.argv[2] == "run" else 1)
"""


def run_webhook_trainer(tmp_path, sequence, config):
    script = tmp_path / "webhook_trainer.py"
    script.write_text(WEBHOOK_TRAINER)
    done = threading.Event()
    run = JobRun(
        job_id="j_1", attempt="a_1", config=config, dataloader=None, work_dir=tmp_path / "jobs",
        command=[sys.executable, str(script), str(EVENTS_FILE), sequence], on_exit=lambda run: done.set(), grace=5,
    )  # fmt: skip
    run.start()
    assert done.wait(30), run.log_tail()
    return run


def test_a_trainer_posting_simpletuners_events_gives_the_job_its_progress_and_stages(tmp_path):
    users = {"webhook_type": "discord", "webhook_url": "https://discord.example/hook"}
    run = run_webhook_trainer(tmp_path, "run", {"--max_train_steps": 6, "--webhook_config": users})
    assert run.returncode == 0, run.log_tail()
    progress, _ = run.snapshot()
    assert (progress["step"], progress["total_steps"], progress["fraction"]) == (6, 6, 1.0)
    assert progress["loss"] == pytest.approx(1.0546059608459473) and progress["learning_rate"] == pytest.approx(0.0001)
    assert progress["stage"]["key"] == "training_complete"
    lines = run.log_tail(200).splitlines()
    assert 'webhooks: ["discord", "raw"]' in lines  # the user's webhook kept, ours after it
    assert "[stage] Saving Checkpoint: running - Saving checkpoint to /tmp/h5/tiny/output/checkpoint-2" in lines
    assert run.receiver is None  # closed with the trainer's end
    written = json.loads((run.job_dir / "config.json").read_text())
    assert written["--webhook_config"][0] == users
    assert written["--output_dir"] == str(run.job_dir / "output")


def test_the_trainers_error_event_sums_up_its_failure_for_this_agent_and_a_restarted_one(tmp_path):
    run = run_webhook_trainer(tmp_path, "failure", {"--max_train_steps": 6})
    assert run.returncode == 1
    expected = "Training failed: OSError: We couldn't connect to 'https://huggingface.co' to load this model"
    report = exit_report(run.attempt, 1, None, progress={}, log_tail=run.log_tail(), last_line=run.last_line())
    assert report["error"].startswith(f"Training exited with code 1: {expected}")
    assert read_log(run.job_dir).last_line().startswith(expected)  # kept in trainer_error.json


def test_progress_lines_may_carry_an_eta_and_a_stage_too():
    from worker_agent.progress import format_progress, parse_line

    line = 'SIMPLETUNER_PROGRESS {"step": 3, "total_steps": 10, "eta_seconds": 125.5, "stage": {"key": "cache", "label": "\\u001b[1mCaching\\u001b[0m", "status": "running", "current": 2, "total": 8, "percent": 250}}'
    update = parse_line(line)
    assert update["eta_seconds"] == 125.5
    assert update["stage"] == {"key": "cache", "label": "Caching", "status": "running", "current": 2, "total": 8, "percent": 100.0}
    assert format_progress(update) == "step 3/10 (30%) eta 2m06s [Caching: running]"
    for bad in ({"eta_seconds": -1}, {"eta_seconds": "soon"}, {"stage": {"status": "running"}}, {"stage": "caching"}):
        assert parse_line("SIMPLETUNER_PROGRESS " + json.dumps(bad)) is None, bad
    assert parse_line('SIMPLETUNER_PROGRESS {"message": "first\\nsecond"}') == {"message": "first"}
