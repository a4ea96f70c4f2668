"""End-to-end harness for the worker agent: real ``python -m worker_agent`` processes, run without Django."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

from worker_agent.runner import SUPERVISOR, parent_death_signal

from .harness import REPO_ROOT, expect, poll

LINE_DEADLINE_S = 20
READY_DEADLINE_S = 30
EXIT_DEADLINE_S = 15
KILL_GRACE_S = 10
LOG_TAIL_CHARS = 8000

TRAINER_COMMAND = shlex.join([sys.executable, "-m", "worker_agent.example_trainer"])

# Top-level packages an agent process must never import: the orchestrator's stack and its own apps.
BLOCKED_MODULES = (
    "django",
    "rest_framework",
    "daphne",
    "channels",
    "celery",
    "django_eventstream",
    "simpletuner_site",
    "workers",
    "job_queue",
    "audit",
)
BLOCKED_MARK = "blocked by the e2e tests: the worker agent must run without the orchestrator's stack"

_SITECUSTOMIZE = f'''"""Written by the e2e tests: any import of the orchestrator's stack fails in this interpreter."""

import sys

_BLOCKED = frozenset({BLOCKED_MODULES!r})


class _OrchestratorStackBlocker:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} ({BLOCKED_MARK})", name=name)
        return None


sys.meta_path.insert(0, _OrchestratorStackBlocker())
'''

# Environment of the test process that must not reach an agent (it configures its own).
_SCRUBBED_ENV = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "DJANGO_SECRET_KEY", "DJANGO_DEBUG", "PYTHONPATH")


def write_import_blocker(directory):
    """Write ``sitecustomize.py`` blocking BLOCKED_MODULES into ``directory``; return the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return directory


def agent_environment(blocker_dir, **overrides):
    """Return an environment for agent processes: no orchestrator settings, Django and co. unimportable.

    ``overrides`` are added last (a value of None removes the variable).
    """
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV and not k.startswith("SIMPLETUNER_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(blocker_dir), str(REPO_ROOT)]),
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class AgentProcess:
    """One agent subprocess; stdout and stderr go to one log file, read back by the test."""

    def __init__(self, *, label, argv, env, cwd, log_path, work_dir=None, worker=None):
        self.label = label
        self.argv = argv
        self.log_path = Path(log_path)
        self.work_dir = Path(work_dir) if work_dir is not None else None
        self.worker = worker
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=parent_death_signal(),
            )
        self.pid = self.process.pid

    # output

    def output(self):
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def lines(self):
        return self.output().splitlines()

    def describe(self):
        text = self.output()
        if len(text) > LOG_TAIL_CHARS:
            text = "...\n" + text[-LOG_TAIL_CHARS:]
        state = "running" if self.process.poll() is None else f"exited {self.process.returncode}"
        return f"agent {self.label} (pid {self.pid}, {state}), log {self.log_path}:\n{text}"

    def wait_for_line(self, pattern, *, timeout=LINE_DEADLINE_S, after=0):
        """Return the index of the first line from ``after`` on containing ``pattern`` (a str or a compiled regex).

        Fail after ``timeout`` seconds, or as soon as the process has exited without printing it.
        """
        deadline = time.monotonic() + timeout
        while True:
            exited = self.process.poll() is not None
            for index, line in enumerate(self.lines()[after:], start=after):
                if (pattern.search(line) if isinstance(pattern, re.Pattern) else pattern in line):
                    return index
            if exited:
                raise AssertionError(f"no line matching {pattern!r}: the agent exited\n{self.describe()}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"no line matching {pattern!r} within {timeout}s\n{self.describe()}")
            time.sleep(0.05)

    def lines_matching(self, pattern):
        return [line for line in self.lines() if (pattern.search(line) if isinstance(pattern, re.Pattern) else pattern in line)]

    def has_line(self, pattern):
        return bool(self.lines_matching(pattern))

    # lifecycle

    def running(self):
        return self.process.poll() is None

    def wait_exit(self, timeout=EXIT_DEADLINE_S):
        """Return the exit status once the process ends; fail if it still runs after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent still runs {timeout}s later\n{self.describe()}") from None

    def assert_keeps_running(self, seconds):
        """Assert the process is alive now and stays alive for ``seconds`` (a negative check with a window)."""
        try:
            code = self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return
        raise AssertionError(f"the agent exited with {code} within {seconds}s\n{self.describe()}")

    def send_signal(self, signum):
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        """SIGKILL the agent (its trainer gets SIGTERM from its own parent-death signal) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass


def trainer_processes(job_dir, *, supervisors=False):
    """Return the live processes running in ``job_dir`` (the trainer runs with the job dir as its cwd),
    its supervisor (worker_agent/supervisor.py) left out unless ``supervisors``."""
    wanted = os.path.realpath(job_dir)
    found = []
    for process in psutil.process_iter(["pid", "cwd", "status", "cmdline"]):
        cwd = process.info.get("cwd")
        if not cwd or os.path.realpath(cwd) != wanted or process.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if supervisors or SUPERVISOR not in (process.info.get("cmdline") or ()):
            found.append(process)
    return found


def process_gone(process):
    """Return True once ``process`` (a psutil.Process) has ended (reaped, or a zombie nobody reaped yet)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class AgentRunner:
    """Starts agent processes for one test against one orchestrator; kills every one of them afterwards.

    Every process runs with an environment where Django, DRF, daphne, channels, celery and the
    orchestrator's own packages cannot be imported.
    """

    def __init__(self, orchestrator, fleet, base_dir, *, blocker_dir, heartbeat="1", cancel_grace="5"):
        self.orch = orchestrator
        self.fleet = fleet
        self.base_dir = Path(base_dir)
        self.blocker_dir = blocker_dir
        self.defaults = {"SIMPLETUNER_HEARTBEAT_INTERVAL": heartbeat, "SIMPLETUNER_CANCEL_GRACE": cancel_grace}
        self.agents = []
        self.jobs = []

    def env(self, **overrides):
        return agent_environment(self.blocker_dir, **{**self.defaults, **overrides})

    def spawn(self, args, *, label=None, env=None, work_dir=None, worker=None):
        """Start ``python -m worker_agent *args`` with ``env`` (default: self.env()); return the AgentProcess."""
        label = label or f"agent-{len(self.agents) + 1}"
        home = self.base_dir / label
        home.mkdir(parents=True, exist_ok=True)
        agent = AgentProcess(
            label=label,
            argv=[sys.executable, "-m", "worker_agent", *args],
            env=self.env() if env is None else env,
            cwd=home,
            log_path=home / "agent.log",
            work_dir=work_dir,
            worker=worker,
        )
        self.agents.append(agent)
        return agent

    def start(self, worker, *, persistent=True, token_in_env=True, extra_args=(), env=None, orchestrator_url=None):
        """Start an agent for ``worker`` (a WorkerHandle) running the example trainer; return it.

        ``orchestrator_url`` replaces the orchestrator's own URL (e.g. a proxy in front of it).
        """
        label = f"agent-{len(self.agents) + 1}"
        work_dir = self.base_dir / label / "jobs"
        args = [
            "--orchestrator-url", orchestrator_url or self.orch.base_url,
            "--name", worker.name,
            "--work-dir", str(work_dir),
            "--command", TRAINER_COMMAND,
        ]  # fmt: skip
        if persistent:
            args.append("--persistent")
        overrides = dict(env or {})
        if token_in_env:
            overrides["SIMPLETUNER_WORKER_TOKEN"] = worker.token
        else:
            args += ["--worker-token", worker.token]
        # The agent keeps the worker's job dirs in <work dir>/<worker id> (worker_agent.journal).
        return self.spawn([*args, *extra_args], label=label, env=self.env(**overrides), work_dir=work_dir / worker.id, worker=worker)

    def again(self, agent, *, label):
        """Start the next agent of ``agent``'s worker on its node: the same arguments (its work dir among them)."""
        worker = agent.worker
        env = self.env(SIMPLETUNER_WORKER_TOKEN=worker.token)
        return self.spawn(agent.argv[3:], label=label, env=env, work_dir=agent.work_dir, worker=worker)

    def wait_ready(self, agent, *, timeout=READY_DEADLINE_S):
        """Wait until ``agent`` has registered and the orchestrator sees its stream open; return the worker state."""
        agent.wait_for_line(f"Registered as {agent.worker.name} ({agent.worker.id})", timeout=timeout)

        def ready():
            state = agent.worker.state()
            return state if state["stream_connected"] and state["status"] in ("idle", "draining") else None

        try:
            return poll(ready, timeout=timeout, interval=0.1, message=f"worker {agent.worker.name} to be connected")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{agent.describe()}") from None

    def submit(self, *, labels, config, **fields):
        """Submit a job for workers matching ``labels``; remembered so teardown can cancel it if still live."""
        submitted = self.fleet.submit({"config_name": "e2e-agent", "config": config, "worker_labels": labels, **fields})
        self.jobs.append(submitted["job_id"])
        return submitted

    def cleanup(self):
        """Kill every agent (and any trainer left in their job dirs), cancel live jobs, print the agents' logs."""
        for agent in self.agents:
            agent.kill()
        for agent in self.agents:
            if agent.work_dir is not None and agent.work_dir.is_dir():
                # Job dirs, or (a work dir given whole, as the soak does) worker dirs holding them.
                for job_dir in [*agent.work_dir.glob("*"), *agent.work_dir.glob("*/*")]:
                    for process in trainer_processes(job_dir, supervisors=True):
                        process.kill()
        for job_id in self.jobs:
            try:
                self.orch.admin("POST", f"/api/queue/{job_id}/cancel")  # 409 for a finished job: fine
            except requests.RequestException:
                pass
        for agent in self.agents:  # shown by pytest for a failing test only
            print(f"\n===== {agent.describe()}")


def job_when(orchestrator, job_id, predicate, *, timeout, message):
    """Poll ``GET /api/queue/{job_id}`` until ``predicate(job)``; return the job."""

    def check():
        job = orchestrator.job(job_id)
        return job if predicate(job) else None

    try:
        return poll(check, timeout=timeout, interval=0.1, message=message)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\njob now: {orchestrator.job(job_id)}") from None


def job_in(orchestrator, job_id, *statuses, timeout=30):
    """Poll until the job's status is one of ``statuses``; return the job."""
    return job_when(
        orchestrator, job_id, lambda job: job["status"] in statuses, timeout=timeout, message=f"job {job_id} {statuses}"
    )


def job_mid_run(orchestrator, job_id, *, timeout=30):
    """Poll until the job runs with progress strictly between 0 and 1; return the job."""

    def mid_run(job):
        if job["status"] not in ("running", "dispatched"):
            assert job["status"] == "queued", f"job {job_id} went {job['status']} before progress was seen: {job}"
        fraction = (job["progress"] or {}).get("fraction")
        return job["status"] == "running" and fraction is not None and 0 < fraction < 1

    return job_when(orchestrator, job_id, mid_run, timeout=timeout, message=f"job {job_id} running mid-way")


def worker_when(orchestrator, worker_id, predicate, *, timeout=15, message="worker state"):
    def check():
        state = orchestrator.worker(worker_id)
        return state if predicate(state) else None

    return poll(check, timeout=timeout, interval=0.1, message=message)


def admin_post(orchestrator, path, status=200):
    return expect(orchestrator.admin("POST", path), status)
