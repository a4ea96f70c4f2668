"""The `simpletuner` user commands end to end (issue 31): real `python -m simpletuner_cli` processes, run without
Django (the agents' import blocker), against a real orchestrator and real agents running the example trainer."""

import hashlib
import io
import json
import os
import pty
import re
import stat
import subprocess
import sys
import time

import pytest

from simpletuner_cli.client import Client, Credentials
from simpletuner_cli.follow import JobWatch

from .agent_harness import agent_environment, job_in
from .harness import REPO_ROOT, expect, free_port, poll

pytestmark = pytest.mark.e2e

COMMAND_DEADLINE_S = 60
SHORT_JOB = {"max_train_steps": 35, "step_delay": 0.1, "checkpoint_every": 10, "seed": 3}
FAILING_JOB = {"max_train_steps": 30, "step_delay": 0.05, "fail_at_step": 8}
LONG_JOB = {"max_train_steps": 2000, "step_delay": 0.05}
PROGRESS_LINE = re.compile(r"^step \d+/35 loss \d", re.MULTILINE)


class CLI:
    """Runs `simpletuner` as a user would, with its own config home; Django and the server's apps unimportable."""

    def __init__(self, tmp_path, blocker_dir, orchestrator):
        self.home = tmp_path / "config-home"
        self.env = agent_environment(blocker_dir, XDG_CONFIG_HOME=str(self.home), COLUMNS="120")
        self.orchestrator = orchestrator

    def argv(self, *args):
        return [sys.executable, "-m", "simpletuner_cli", *args]

    def run(self, *args, stdin=None, env=None, timeout=COMMAND_DEADLINE_S):
        return subprocess.run(
            self.argv(*args), cwd=REPO_ROOT, env={**self.env, **(env or {})}, input=stdin, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def ok(self, *args, **kwargs):
        result = self.run(*args, **kwargs)
        assert result.returncode == 0, f"simpletuner {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def start(self, *args):
        return subprocess.Popen(
            self.argv(*args), cwd=REPO_ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def login(self):
        self.ok("login", "--url", self.orchestrator.base_url, stdin=self.orchestrator.admin_token + "\n")


@pytest.fixture
def cli(tmp_path, blocker_dir, orchestrator):
    return CLI(tmp_path, blocker_dir, orchestrator)


@pytest.fixture
def worker_agent(fleet, agents):
    """One real agent on a worker labelled with the test's pool; returns the label selector for its jobs."""
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agents.wait_ready(agents.start(worker))
    return f"pool={fleet.tag}"


def submitted(cli, agents, *args):
    """Submit with the CLI; return the job id (remembered, so teardown cancels it if still live)."""
    out = cli.ok("jobs", "submit", *args)
    job_id = out.splitlines()[0]
    assert re.fullmatch(r"j_[0-9a-f]{16}", job_id), out
    agents.jobs.append(job_id)
    return job_id


def test_login_submit_follow_logs_json_and_download(cli, orchestrator, agents, worker_agent, tmp_path):
    out = cli.ok("login", "--url", orchestrator.base_url, stdin=orchestrator.admin_token + "\n")
    credentials = cli.home / "simpletuner" / "credentials"
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    assert json.loads(credentials.read_text()) == {"url": orchestrator.base_url, "token": orchestrator.admin_token}
    assert orchestrator.admin_token not in out

    config = tmp_path / "short.json"
    config.write_text(json.dumps(SHORT_JOB))
    name = f"cli-{worker_agent.rsplit('-', 1)[-1]}"
    assert cli.ok("configs", "push", name, str(config)).strip() == f"{name} version 1"
    assert name in cli.ok("configs", "list")
    assert json.loads(cli.ok("configs", "show", f"{name}@1", "--json"))["config"] == SHORT_JOB

    follow = cli.run("jobs", "submit", name, "--label", worker_agent, "--follow")
    assert follow.returncode == 0, follow.stdout + follow.stderr
    job_id = follow.stdout.splitlines()[0]
    agents.jobs.append(job_id)
    assert PROGRESS_LINE.search(follow.stdout), follow.stdout
    assert follow.stdout.rstrip().endswith("completed") and "step 35/35" in follow.stdout

    listed = json.loads(cli.ok("jobs", "list", "--json", "--limit", "5"))
    assert job_id in [j["id"] for j in listed]
    shown = json.loads(cli.ok("jobs", "show", job_id, "--json"))
    assert (shown["status"], shown["config_name"]) == ("completed", name)
    assert job_id in cli.ok("jobs", "list", "--mine", "--status", "completed")
    assert shown == orchestrator.job(job_id) | {"waiting_reason": shown["waiting_reason"]}

    log = cli.ok("jobs", "logs", job_id)
    assert "training complete: step 35" in log and f"# job {job_id}" in log
    followed = cli.ok("jobs", "logs", job_id, "--follow")  # an ended job: its whole log, then done
    assert "# --- attempt 1 on " in followed and "training complete: step 35" in followed

    dest = tmp_path / "downloads"
    assert "sha256 ok" in cli.ok("jobs", "download", job_id, "--dest", str(dest))
    artifacts = shown["artifacts"]
    assert {"output/checkpoint.json", "output/checkpoint-10/checkpoint.json"} <= {a["key"] for a in artifacts}
    for artifact in artifacts:
        assert hashlib.sha256((dest / artifact["key"]).read_bytes()).hexdigest() == artifact["sha256"]

    # An interrupted download: half a file left as FILE.part is resumed from its end (a Range request), not refetched.
    final = dest / "output" / "checkpoint.json"
    whole = final.read_bytes()
    final.unlink()
    final.with_name("checkpoint.json.part").write_bytes(whole[: len(whole) // 2])
    again = cli.ok("jobs", "download", job_id, "--dest", str(dest))
    assert f"output/checkpoint.json  {len(whole)} B  sha256 ok, resumed at {len(whole) // 2} bytes" in again
    assert "output/checkpoint-10/checkpoint.json" in again and "already here" in again
    assert final.read_bytes() == whole
    # A partial file that is not the server's is caught by the checksum and removed; the next run fetches it whole.
    final.unlink()
    final.with_name("checkpoint.json.part").write_bytes(b"X" * (len(whole) // 2))
    corrupted = cli.run("jobs", "download", job_id, "--dest", str(dest))
    assert corrupted.returncode == 3 and "is not the server's" in corrupted.stderr
    cli.ok("jobs", "download", job_id, "--dest", str(dest))
    assert final.read_bytes() == whole


def test_a_failing_job_exits_1_and_a_cancelled_one_2(cli, orchestrator, agents, worker_agent, tmp_path):
    cli.login()
    config = tmp_path / "failing.json"
    config.write_text(json.dumps(FAILING_JOB))
    failing = cli.run("jobs", "submit", "--config", str(config), "--label", worker_agent, "--follow")
    agents.jobs.append(failing.stdout.splitlines()[0])
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert failing.stdout.rstrip().splitlines()[-1].startswith("failed: ") and "fail_at_step" in failing.stdout

    config.write_text(json.dumps(LONG_JOB))
    job_id = submitted(cli, agents, "--config", str(config), "--label", worker_agent)
    watch, logs = cli.start("jobs", "watch", job_id), cli.start("jobs", "logs", job_id, "--follow")
    try:
        poll(lambda: (orchestrator.job(job_id)["progress"] or {}).get("step", 0) >= 5, timeout=30, message="the job to train")
        assert cli.ok("jobs", "cancel", job_id).strip() == f"{job_id} cancelled"
        watched, _ = watch.communicate(timeout=COMMAND_DEADLINE_S)
        logged, _ = logs.communicate(timeout=COMMAND_DEADLINE_S)
    finally:
        for process in (watch, logs):
            process.kill()
    assert watch.returncode == 2, watched
    assert re.search(r"^step \d+/2000 loss", watched, re.MULTILINE) and watched.rstrip().endswith("cancelled")
    assert logs.returncode == 2 and "example trainer: logistic regression" in logged, logged

    retried = cli.ok("jobs", "retry", job_id).splitlines()[0]
    agents.jobs.append(retried)
    assert retried != job_id and orchestrator.job(retried)["retry_of"] == job_id
    cli.ok("jobs", "cancel", retried)
    job_in(orchestrator, retried, "cancelled")


def test_on_a_terminal_watch_draws_a_bar_and_a_job_already_ended_ends_it_at_once(cli, agents, worker_agent, tmp_path):
    cli.login()
    config = tmp_path / "tty.json"
    config.write_text(json.dumps({"max_train_steps": 30, "step_delay": 0.1}))
    job_id = submitted(cli, agents, "--config", str(config), "--label", worker_agent)
    primary, secondary = pty.openpty()
    watch = subprocess.Popen(cli.argv("jobs", "watch", job_id), cwd=REPO_ROOT, env=cli.env, stdout=secondary, stderr=subprocess.PIPE)
    os.close(secondary)
    screen = b""
    try:
        while chunk := _read_pty(primary):
            screen += chunk
        assert watch.wait(timeout=COMMAND_DEADLINE_S) == 0, screen
    finally:
        watch.kill()
        os.close(primary)
    text = screen.decode()
    assert re.search(r"\r\x1b\[2K\[#*\.*\]  \d+/30  \d+%  loss \d", text), text  # the bar, redrawn in place
    assert text.rstrip().endswith("completed")

    started = time.monotonic()
    again = cli.run("jobs", "watch", job_id)  # ended already: read once, never waiting on the feed
    assert (again.returncode, again.stdout.splitlines()[-1]) == (0, "completed")
    assert time.monotonic() - started < 15


def _read_pty(fd):
    """The next bytes the terminal shows, or b"" once the program closed it."""
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: every writer has closed it
        return b""


def test_an_end_between_the_first_read_and_the_feed_opening_is_seen_at_once(orchestrator, agents, worker_agent):
    """The race, staged in this process against the real server: the watch's first read sees the job running, the
    job completes, and only then does the feed open. The read on opening sees the end; without it the watch would
    wait for the feed's keep-alive (20 s), since nothing more is announced about the job."""
    client = Client(Credentials(url=orchestrator.base_url, token=orchestrator.admin_token))
    key, _, value = worker_agent.partition("=")
    job_id = agents.submit(labels={key: value}, config={"max_train_steps": 20, "step_delay": 0.05})["job_id"]
    opened = client.open_feed

    def open_once_it_ended():
        job_in(orchestrator, job_id, "completed", "failed", "cancelled")
        return opened()

    client.open_feed = open_once_it_ended
    out = io.StringIO()
    started = time.monotonic()
    first = client.job(job_id)
    assert first["status"] not in ("completed", "failed", "cancelled"), first
    assert JobWatch(client, job_id, out=out, tty=False).run(first) == 0
    assert out.getvalue().splitlines()[-1] == "completed"
    assert time.monotonic() - started < 15, "the end was only noticed at a keep-alive"


def test_errors_say_what_to_do(cli, orchestrator):
    unknown = cli.run("jobs", "show", "j_0000000000000000", env={"SIMPLETUNER_URL": orchestrator.base_url, "SIMPLETUNER_TOKEN": orchestrator.admin_token})
    assert unknown.returncode == 3 and "no job j_0000000000000000 on" in unknown.stderr

    bad = cli.run("login", "--url", orchestrator.base_url, "--token", "sta_not-a-real-token")
    assert bad.returncode == 3 and "401: the token was revoked or expired" in bad.stderr
    assert "sta_not-a-real-token" not in bad.stdout + bad.stderr
    assert not (cli.home / "simpletuner" / "credentials").exists()

    assert "not logged in: run simpletuner login --url" in cli.run("jobs", "list").stderr

    down = f"http://127.0.0.1:{free_port()}"
    for args in (("jobs", "list"), ("jobs", "watch", "j_0000000000000000"), ("workers", "list")):
        result = cli.run(*args, env={"SIMPLETUNER_URL": down, "SIMPLETUNER_TOKEN": orchestrator.admin_token})
        assert result.returncode == 3 and f"the server at {down} is unreachable" in result.stderr, result.stderr
    unreachable = cli.run("login", "--url", down, stdin="sta_x\n")
    assert unreachable.returncode == 3 and down in unreachable.stderr


def test_workers_list_and_json(cli, orchestrator, fleet):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    cli.login()
    assert worker.name in cli.ok("workers", "list")
    listed = json.loads(cli.ok("workers", "list", "--json"))
    assert worker.id in {w["id"] for w in listed}
    assert expect(orchestrator.admin("GET", f"/api/admin/workers/{worker.id}"), 200)["name"] == worker.name
    assert os.path.exists(cli.home / "simpletuner" / "credentials")
