"""The built-in local worker's supervisor, with a tiny Python program standing in for the agent."""

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from common.errors import Conflict
from simpletuner_cli import local_worker as lw
from tests.e2e.harness import REPO_ROOT, poll
from workers.models import Token, TokenKind, Worker, WorkerType
from workers.services import token_authenticate

DEADLINE_S = 20
URL = "http://127.0.0.1:8001"
NAME = "local@testhost"
TOKEN = "wt_first-token-0123456789"

RUN_UNTIL_TERMINATED = "import time\nprint('agent up', flush=True)\nwhile True: time.sleep(0.05)"
# Counts SIGTERMs instead of dying of them, like an agent whose job will not stop.
IGNORE_SIGTERM = textwrap.dedent(
    """
    import signal, time
    count = 0
    def on_term(signum, frame):
        global count
        count += 1
        print(f"TERM {count}", flush=True)
    signal.signal(signal.SIGTERM, on_term)
    print("agent up", flush=True)
    while True:
        time.sleep(0.05)
    """
)


class StandIn:
    """A ``popen`` that runs one of ``scripts`` (the last one repeats) instead of the agent.

    It keeps the argv and keyword arguments the supervisor gave, and the processes it started.
    """

    def __init__(self, *scripts):
        self.scripts = scripts
        self.calls = []
        self.processes = []

    def __call__(self, argv, **kwargs):
        script = self.scripts[min(len(self.calls), len(self.scripts) - 1)]
        self.calls.append((argv, kwargs))
        process = subprocess.Popen([sys.executable, "-c", script], **kwargs)
        self.processes.append(process)
        return process


class Provisioner:
    """A ``provision`` that hands out ``tokens`` in turn (the last one repeats) and records its calls."""

    def __init__(self, *tokens, error=None):
        self.tokens = tokens or (TOKEN,)
        self.error = error
        self.calls = []

    def __call__(self, name, stored):
        self.calls.append((name, stored))
        if self.error is not None:
            raise self.error
        return self.tokens[min(len(self.calls), len(self.tokens)) - 1]


class Output(list):
    """The supervisor's output lines, appended from its thread."""

    def __call__(self, line):
        self.append(line)

    def wait_for(self, text):
        return poll(lambda: any(text in line for line in list(self)), timeout=DEADLINE_S, message=repr(text))


@pytest.fixture
def make_worker(tmp_path):
    """``make_worker(popen, **kwargs)``: a LocalWorker on ``tmp_path/data``; every one is stopped after the test."""
    made = []

    def make(popen, **kwargs):
        kwargs.setdefault("provision", Provisioner())
        kwargs.setdefault("output", Output())
        kwargs.setdefault("backoff", lw.RestartBackoff(initial=0.01, cap=0.04, healthy_after=3600))
        kwargs.setdefault("second_signal_after", 0.1)
        worker = lw.LocalWorker(url=URL, data_dir=tmp_path / "data", name=NAME, popen=popen, **kwargs)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop(timeout=2)


# --- command line, environment, token file --------------------------------------------------
def test_the_token_travels_only_in_the_environment(make_worker, tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_WORKER_COMMAND", "python train.py --fast")
    monkeypatch.setenv("DATABASE_URL", "postgres://app:db-s3cret@db/st")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "s3cret")
    popen = StandIn(RUN_UNTIL_TERMINATED)
    worker = make_worker(popen, ca_cert=tmp_path / "cert.pem", verbose=True)

    assert worker.start() is True

    [(argv, kwargs)] = popen.calls
    data_dir = tmp_path / "data"
    assert argv == [
        sys.executable,
        "-m",
        "worker_agent",
        "--orchestrator-url",
        URL,
        "--name",
        NAME,
        "--persistent",
        "--work-dir",
        str(data_dir / "jobs"),
        "--ca-cert",
        str(tmp_path / "cert.pem"),
        "-v",
    ]
    assert not any(TOKEN in part for part in argv)
    assert kwargs["env"]["SIMPLETUNER_WORKER_TOKEN"] == TOKEN
    assert kwargs["env"]["SIMPLETUNER_WORKER_COMMAND"] == "python train.py --fast"
    assert "DATABASE_URL" not in kwargs["env"] and "DJANGO_SECRET_KEY" not in kwargs["env"]
    assert kwargs["start_new_session"] is True
    assert (data_dir / "jobs").is_dir()


def test_without_ca_cert_or_verbose_the_agent_gets_neither_flag(make_worker):
    popen = StandIn(RUN_UNTIL_TERMINATED)

    make_worker(popen).start()

    argv = popen.calls[0][0]
    assert "--ca-cert" not in argv and "-v" not in argv


def test_token_file_is_private_and_its_token_offered_again(make_worker, tmp_path):
    provision = Provisioner(TOKEN)
    first = make_worker(StandIn(RUN_UNTIL_TERMINATED), provision=provision)
    first.start()
    token_path = tmp_path / "data" / "local-worker.token"

    assert token_path.read_text().strip() == TOKEN
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    first.stop(timeout=2)

    renewed = Provisioner("wt_second-token")
    make_worker(StandIn(RUN_UNTIL_TERMINATED), provision=renewed).start()

    assert provision.calls == [(NAME, None)]
    assert renewed.calls == [(NAME, TOKEN)]  # the stored token is offered for reuse
    assert token_path.read_text().strip() == "wt_second-token"
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert [p.name for p in token_path.parent.iterdir() if p.name.startswith(".")] == []


def test_a_loose_token_file_is_made_private(make_worker, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "local-worker.token").write_text(TOKEN)
    os.chmod(data_dir / "local-worker.token", 0o644)

    make_worker(StandIn(RUN_UNTIL_TERMINATED)).start()

    assert stat.S_IMODE((data_dir / "local-worker.token").stat().st_mode) == 0o600


# --- output -----------------------------------------------------------------------------------
def test_agent_output_is_echoed_with_a_prefix_and_the_token_masked(make_worker):
    script = (
        "import os, sys, time\n"
        "print('registered as local worker', flush=True)\n"
        "print('token is ' + os.environ['SIMPLETUNER_WORKER_TOKEN'], file=sys.stderr, flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    output = Output()
    make_worker(StandIn(script), output=output).start()

    output.wait_for("token is")

    assert "[local worker] registered as local worker" in output
    assert "[local worker] token is ****" in output
    assert not any(TOKEN in line for line in output)


# --- restarts ---------------------------------------------------------------------------------
def test_an_agent_that_exits_is_restarted_with_growing_delays(make_worker):
    output = Output()
    provision = Provisioner()
    popen = StandIn("import sys; print('fatal: token refused', flush=True); sys.exit(1)")
    make_worker(popen, output=output, provision=provision).start()

    poll(lambda: len(popen.calls) >= 5, timeout=DEADLINE_S, message="five starts")

    restarts = [line for line in list(output) if line.startswith("local worker: ")]
    delays = ("0.01", "0.02", "0.04", "0.04")
    assert restarts[:4] == [f"local worker: agent exited with code 1; restarting in {d} s" for d in delays]
    assert "[local worker] fatal: token refused" in output
    assert len(provision.calls) >= 5  # re-provisioned at every start: a revoked token is replaced
    assert all(call == (NAME, TOKEN) for call in provision.calls[1:])


def test_a_restart_that_cannot_provision_is_reported_and_tried_again(make_worker):
    output = Output()
    provision = Provisioner()
    popen = StandIn("import sys; sys.exit(3)", RUN_UNTIL_TERMINATED)
    worker = make_worker(popen, output=output, provision=provision)
    worker.start()
    provision.error = Conflict("database is locked")

    output.wait_for("could not start the agent (database is locked); restarting in")
    provision.error = None
    output.wait_for("[local worker] agent up")

    assert len(popen.calls) == 2
    assert worker.process.poll() is None


def test_backoff_doubles_to_its_cap_and_resets_after_a_healthy_run():
    backoff = lw.RestartBackoff()

    delays = [backoff.delay(ran_for=0) for _ in range(8)]
    after_healthy_run = backoff.delay(ran_for=60)

    assert delays == [1, 2, 4, 8, 16, 32, 60, 60]
    assert after_healthy_run == 1
    assert backoff.delay(ran_for=59) == 2


# --- stopping ---------------------------------------------------------------------------------
def test_stop_escalates_sigterm_twice_more_then_sigkill(make_worker, monkeypatch):
    monkeypatch.setattr(lw, "KILL_AFTER_S", 0.3)
    output = Output()
    popen = StandIn(IGNORE_SIGTERM)
    worker = make_worker(popen, output=output)
    worker.start()
    output.wait_for("[local worker] agent up")

    worker.stop(timeout=0.3)

    process = popen.processes[0]
    assert process.returncode == -signal.SIGKILL
    assert [line for line in output if "TERM" in line] == [f"[local worker] TERM {n}" for n in (1, 2, 3)]
    assert not any("restarting" in line for line in output)
    assert len(popen.calls) == 1


def test_an_agent_that_obeys_the_first_sigterm_gets_no_more(make_worker):
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('TERM: leaving', flush=True), sys.exit(0)))\n"
        "print('agent up', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    output = Output()
    popen = StandIn(script)
    worker = make_worker(popen, output=output)
    worker.start()
    output.wait_for("agent up")

    worker.stop(timeout=5)
    worker.stop(timeout=5)  # idempotent

    assert popen.processes[0].returncode == 0
    assert [line for line in output if "TERM" in line] == ["[local worker] TERM: leaving"]
    assert not any("restarting" in line for line in output)


def test_stop_during_the_restart_delay_starts_nothing(make_worker):
    output = Output()
    popen = StandIn("import sys; sys.exit(1)")
    worker = make_worker(popen, output=output, backoff=lw.RestartBackoff(initial=30))
    worker.start()
    output.wait_for("restarting in 30 s")

    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    stopper.join(DEADLINE_S)

    assert not stopper.is_alive()
    assert len(popen.calls) == 1


# --- one local worker per data dir ----------------------------------------------------------
def test_a_second_supervisor_on_the_data_dir_stands_down(make_worker):
    first = make_worker(StandIn(RUN_UNTIL_TERMINATED))
    assert first.start() is True

    output, provision, popen = Output(), Provisioner(), StandIn(RUN_UNTIL_TERMINATED)
    second = make_worker(popen, output=output, provision=provision)

    assert second.start() is False
    assert output == ["local worker: another server process on this data dir runs it"]
    assert (provision.calls, popen.calls) == ([], [])

    first.stop(timeout=2)
    assert make_worker(StandIn(RUN_UNTIL_TERMINATED)).start() is True


def test_a_provisioning_failure_at_start_is_reported_and_retried(make_worker):
    output = Output()
    provision = Provisioner(error=Conflict("a worker named 'local@testhost' already exists and is a persistent worker"))
    popen = StandIn(RUN_UNTIL_TERMINATED)
    worker = make_worker(popen, output=output, provision=provision)

    assert worker.start() is True
    output.wait_for("local worker: could not start the agent (a worker named 'local@testhost' already exists")
    assert popen.calls == []
    assert make_worker(StandIn(RUN_UNTIL_TERMINATED)).start() is False  # it still holds the data dir

    provision.error = None
    output.wait_for("[local worker] agent up")
    assert len(popen.calls) == 1


SUPERVISOR = """
import sys, time
from pathlib import Path
from simpletuner_cli.local_worker import LocalWorker

agent = "import os, time\\nprint(os.getpid(), flush=True)\\nwhile True: time.sleep(0.05)"
worker = LocalWorker(
    url="http://127.0.0.1:1", data_dir=Path(sys.argv[1]), name="local@test",
    provision=lambda name, stored: "wt_x",
    popen=lambda argv, **kwargs: __import__("subprocess").Popen([sys.executable, "-c", agent], **kwargs),
    output=lambda line: print(line, flush=True),
)
worker.start()
time.sleep(600)
"""


def test_the_agent_dies_with_a_killed_server(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "simpletuner_site.settings", "SIMPLETUNER_DATA_DIR": str(tmp_path)}
    server = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path / "data")],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        assert line.startswith("[local worker] "), line
        agent = psutil.Process(int(line.split()[-1]))

        server.kill()
        server.wait(DEADLINE_S)

        def agent_gone():
            try:
                return agent.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        poll(agent_gone, timeout=DEADLINE_S, message="the agent to die with its server")
    finally:
        server.kill()
        server.wait()


# --- the real provisioning service -------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_restarts_keep_the_provisioned_token(make_worker, tmp_path):
    output = Output()
    popen = StandIn("import sys; sys.exit(1)", RUN_UNTIL_TERMINATED)
    worker = make_worker(popen, output=output, provision=lw.provision_local_worker)

    worker.start()
    output.wait_for("[local worker] agent up")

    token = (tmp_path / "data" / "local-worker.token").read_text().strip()
    local = Worker.objects.get(name=NAME)
    assert local.worker_type == WorkerType.LOCAL
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=token).worker_id == local.pk
    assert Token.objects.filter(worker=local).count() == 1  # the restart reused it
    assert popen.calls[1][1]["env"]["SIMPLETUNER_WORKER_TOKEN"] == token


# --- its name -------------------------------------------------------------------------------------
def test_name_defaults_to_local_at_host_and_can_be_set(monkeypatch):
    from django.core.exceptions import ImproperlyConfigured

    from simpletuner_site import settings as site_settings

    monkeypatch.delenv("SIMPLETUNER_LOCAL_WORKER_NAME", raising=False)
    assert site_settings._local_worker_name() == f"local@{socket.gethostname()}"
    monkeypatch.setenv("SIMPLETUNER_LOCAL_WORKER_NAME", " gpu-box ")
    assert site_settings._local_worker_name() == "gpu-box"
    monkeypatch.setenv("SIMPLETUNER_LOCAL_WORKER_NAME", "x" * 129)
    with pytest.raises(ImproperlyConfigured, match="SIMPLETUNER_LOCAL_WORKER_NAME must be at most 128"):
        site_settings._local_worker_name()
