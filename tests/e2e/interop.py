"""The real SimpleTuner trainer for ``make interop``: where its venv and the tiny job builder live, the tiny job,
and the command an agent runs it with (test environment only); and a node and its checkpoints as a test sees
them (its job directory, the checkpoints the orchestrator holds complete, killing it).

``python -m tests.e2e.interop`` prints why the proof cannot run here, or nothing when it can.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .agent_harness import AgentRunner, trainer_processes, write_import_blocker
from .harness import REPO_ROOT, Fleet, own_orchestrator, poll

# SimpleTuner's venv as ../shared/peer/build.sh makes it (its .peer-ok records the snapshot it holds).
PEER_VENV = Path(os.environ.get("PEER_VENV") or Path(tempfile.gettempdir()) / "peer-venv")
PEER_PYTHON = PEER_VENV / "bin" / "python"
REALTRAIN_DIR = Path(os.environ.get("REALTRAIN_DIR") or REPO_ROOT.parent / "shared" / "realtrain")
# make_tiny.py's CPU workarounds (a usable torchvision, the pin_memory shim), made once and reused.
PYDEPS = Path(os.environ.get("REALTRAIN_PYDEPS") or Path(tempfile.gettempdir()) / "realtrain" / "pydeps")
BUILD_TIMEOUT_S = 600

# The environment run.sh (make_tiny.py) gives the trainer: offline, no colour, no torch.compile probe.
TRAINER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "SIMPLETUNER_DISABLE_COLORS": "1",
    "SDNQ_USE_TORCH_COMPILE": "0",
}
# Set in an agent's environment, its trainers pause this long after writing that checkpoint's marker:
# "checkpoint-4:60". The test's window to kill a node between two checkpoints.
PAUSE_ENV = "INTEROP_PAUSE_AFTER_GUARD"
_PAUSE = f'''

# --- added by tests/e2e/interop.py: pause after a checkpoint's marker ({PAUSE_ENV}) -----------------
def _interop_pause():
    import pathlib
    import time

    name, _, seconds = os.environ.get("{PAUSE_ENV}", "").partition(":")
    if not name:
        return
    replace = pathlib.Path.replace

    def replace_then_pause(self, target):
        result = replace(self, target)
        target = pathlib.Path(target)
        if target.name == ".guard" and target.parent.name == name:
            time.sleep(float(seconds))
        return result

    pathlib.Path.replace = replace_then_pause


_interop_pause()
'''


def missing():
    """Return why the interop proof cannot run here, or None."""
    if not (PEER_VENV / ".peer-ok").is_file() or not PEER_PYTHON.exists():
        return f"no SimpleTuner snapshot venv at {PEER_VENV} (build it with ../shared/peer/build.sh; PEER_VENV moves it)"
    if not (REALTRAIN_DIR / "make_tiny.py").is_file():
        return f"no make_tiny.py in {REALTRAIN_DIR} (REALTRAIN_DIR moves it)"
    return None


class TinyJob:
    """make_tiny.py's job in ``out``: its config and dataloader as stored, and the trainer's command."""

    def __init__(self, out):
        self.out = Path(out)
        self.shim = self.out / "shim"

    def build(self):
        """Run make_tiny.py (model, data, configs; the CPU workarounds into PYDEPS once), write the shim; return self."""
        result = subprocess.run(
            [str(PEER_PYTHON), str(REALTRAIN_DIR / "make_tiny.py"), "--out", str(self.out), "--pydeps", str(PYDEPS),
             "--python", str(PEER_PYTHON)],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"make_tiny.py exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        self.shim.mkdir(parents=True, exist_ok=True)
        (self.shim / "sitecustomize.py").write_text((PYDEPS / "sitecustomize.py").read_text() + _PAUSE)
        return self

    @property
    def config(self):
        return json.loads((self.out / "config" / "config.json").read_text())

    @property
    def dataloader(self):
        return json.loads((self.out / "config" / "multidatabackend.json").read_text())

    def trainer_environment(self):
        """run.sh's environment, with the shim (make_tiny's sitecustomize plus the pause) and PYDEPS as the path."""
        return {"PYTHONPATH": os.pathsep.join([str(self.shim), str(PYDEPS)]), **TRAINER_ENV}

    def command(self):
        """Our agent's ``--command``: SimpleTuner's trainer in its venv, niced, in ``trainer_environment()``."""
        env = self.trainer_environment()
        return shlex.join(
            ["nice", "-n", "10", "env", *(f"{k}={v}" for k, v in env.items()), str(PEER_PYTHON), "-m", "simpletuner.train"]
        )


# --- servers, agents, a node and its checkpoints, as a test sees them (test_interop.py, test_resume.py) ----

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
]


def serve(request, tmp_path, timers):
    """Yield an orchestrator of the test's own on ``request.param`` (one of BACKENDS): ``simpletuner server``
    with ``timers``, and on PostgreSQL a Celery worker running the sweeps."""
    yield from own_orchestrator(request, tmp_path / "orchestrator", via_cli=True, celery=request.param == "postgres", extra_env=timers)


def run_agents(server, tmp_path, tag):
    """Yield an AgentRunner for ``server``; kill its agents and take its workers offline after."""
    fleet = Fleet(server, tag)
    runner = AgentRunner(server, fleet, tmp_path / "agents", blocker_dir=write_import_blocker(tmp_path / "no-django"))
    yield runner
    runner.cleanup()
    fleet.cleanup()



def job_dir_of(agent, job_id):
    """The job's directory on ``agent``'s node, wherever its layout puts it under the work dir."""
    found = poll(lambda: [p for p in agent.work_dir.rglob(job_id) if p.is_dir()], timeout=60, message=f"{job_id}'s directory")
    return found[0]


def completed_steps(server, job_id):
    """The checkpoints the orchestrator holds complete for ``job_id`` (its audit trail), by attempt."""
    rows = server.audit(action="checkpoint.completed", target_id=job_id)
    return {(row["details"]["attempt"], row["details"]["step"]) for row in rows}


def kill_node(agent, job_dir):
    """kill -9 the agent and its trainer's process group together: the node is gone, nothing is reported."""
    groups = {os.getpgid(p.pid) for p in trainer_processes(job_dir, supervisors=True)}
    assert groups, f"no trainer runs in {job_dir}"
    os.kill(agent.pid, signal.SIGKILL)
    for group in groups:
        os.killpg(group, signal.SIGKILL)
    agent.kill()  # reaps it
    poll(lambda: not trainer_processes(job_dir, supervisors=True), timeout=15, message="the trainer to be gone")


if __name__ == "__main__":
    reason = missing()
    if reason:
        print(reason)
    sys.exit(0)
