"""`make demo`: a whole fleet on this machine, on the embedded default, from nothing to every job completed.

It starts `simpletuner server` (SQLite in a fresh temporary data dir, no Redis) with its built-in local
worker, creates two workers with different labels, starts an agent for each with the example trainer,
submits jobs that must land on the right worker by label plus one `local` job, shows their progress
as it comes in, and exits 0 once every job completed (1 if any did not). Everything it started is
stopped on the way out, Ctrl-C included.
"""

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from worker_agent.progress import format_progress

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAINER = f"{shlex.quote(sys.executable)} -m worker_agent.example_trainer"
WORKERS = [("gpu-vision", {"team": "vision"}), ("gpu-nlp", {"team": "nlp"})]
JOBS = [
    ("vision-lr-0.1", {"team": "vision"}, "worker", {"learning_rate": 0.1}),
    ("nlp-lr-0.1", {"team": "nlp"}, "worker", {"learning_rate": 0.1}),
    ("vision-lr-0.3", {"team": "vision"}, "worker", {"learning_rate": 0.3}),
    ("nlp-lr-0.3", {"team": "nlp"}, "worker", {"learning_rate": 0.3}),
    ("local-smoke-test", {}, "local", {"learning_rate": 0.2}),
]
TERMINAL = ("completed", "failed", "cancelled")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def say(message):
    print(f"demo | {message}", flush=True)


class Demo:
    def __init__(self, *, steps, step_delay, keep):
        self.steps = steps
        self.step_delay = step_delay
        self.keep = keep
        self.data_dir = Path(tempfile.mkdtemp(prefix="simpletuner-demo-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes = []
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        self.env.update(
            SIMPLETUNER_DATA_DIR=str(self.data_dir),
            SIMPLETUNER_WORKER_COMMAND=TRAINER,  # the built-in local worker trains with it too
            SIMPLETUNER_HEARTBEAT_INTERVAL="5",
            PYTHONUNBUFFERED="1",
        )
        self.session = requests.Session()

    # --- processes ------------------------------------------------------------------------------

    def spawn(self, name, argv, env=None):
        log = open(self.data_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            argv, cwd=REPO_ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append((name, process, log))
        return process

    def stop_all(self):
        for name, process, log in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                if name != "orchestrator":
                    time.sleep(0.2)
                    if process.poll() is None:
                        os.killpg(process.pid, signal.SIGTERM)  # second signal: stop a running job now
        for name, process, log in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
            log.close()

    # --- API --------------------------------------------------------------------------------------

    def api(self, method, path, **kwargs):
        response = self.session.request(method, self.url + path, timeout=30, **kwargs)
        if response.status_code >= 400:
            raise SystemExit(f"demo | {method} {path} failed: HTTP {response.status_code} {response.text[:300]}")
        return response.json() if response.content else None

    def wait_for_server(self, server):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"demo | the orchestrator exited; see {self.data_dir / 'orchestrator.log'}")
            try:
                requests.get(self.url + "/api/queue/", timeout=1)
                return
            except requests.ConnectionError:
                time.sleep(0.2)
        raise SystemExit("demo | the orchestrator did not start within 60 s")

    # --- the story --------------------------------------------------------------------------------

    def run(self):
        say(f"data dir {self.data_dir} (SQLite, no Redis); logs of every process are written there")
        server = self.spawn(
            "orchestrator",
            [sys.executable, "-m", "simpletuner_cli", "server", "--host", "127.0.0.1", "--port", str(self.port)],
        )
        self.wait_for_server(server)
        say(f"orchestrator up at {self.url}")
        token = subprocess.run(
            [sys.executable, "manage.py", "create_api_token", "demo-admin", "--superuser"],
            cwd=REPO_ROOT, env=self.env, check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        self.session.headers["Authorization"] = f"Bearer {token}"
        say("operator API token created for demo-admin")

        for name, labels in WORKERS:
            created = self.api("POST", "/api/admin/workers", json={"name": name, "worker_type": "persistent", "labels": labels})
            say(f"worker {name} {labels} created ({created['worker_id']}); starting its agent")
            self.spawn(
                name,
                [sys.executable, "-m", "worker_agent", "--orchestrator-url", self.url, "--name", name, "--persistent",
                 "--work-dir", str(self.data_dir / "jobs" / name), "--command", TRAINER],
                env={"SIMPLETUNER_WORKER_TOKEN": created["token"]},
            )
        self.wait_for_workers()

        jobs = {}
        for name, labels, target, config in JOBS:
            body = {
                "config_name": name,
                "target": target,
                "worker_labels": labels,
                "config": {"max_train_steps": self.steps, "step_delay": self.step_delay, "seed": 7, **config},
            }
            job = self.api("POST", "/api/queue/submit", json=body)
            jobs[job["id"]] = (name, labels, target)
            say(f"submitted {name} -> {job['id']} (target {target}{', labels ' + str(labels) if labels else ''})")
        return self.watch(jobs)

    def wait_for_workers(self):
        deadline = time.monotonic() + 60
        wanted = {name for name, _ in WORKERS}
        while time.monotonic() < deadline:
            workers = self.api("GET", "/api/admin/workers")["workers"]
            idle = {w["name"] for w in workers if w["status"] == "idle" and w["stream_connected"]}
            if wanted <= idle:
                say("workers connected and idle: " + ", ".join(sorted(w["name"] for w in workers if w["status"] == "idle")))
                return
            time.sleep(0.3)
        raise SystemExit("demo | the agents did not connect within 60 s; see their logs in " + str(self.data_dir))

    def watch(self, jobs):
        last_line = {}
        deadline = time.monotonic() + max(120, self.steps * self.step_delay * len(jobs) * 3)
        while time.monotonic() < deadline:
            states = {job_id: self.api("GET", f"/api/queue/{job_id}") for job_id in jobs}
            for job_id, job in states.items():
                key, line = describe(jobs[job_id][0], job)
                if key != last_line.get(job_id):
                    last_line[job_id] = key
                    say(line)
            if all(job["status"] in TERMINAL for job in states.values()):
                return self.summary(jobs, states)
            time.sleep(0.5)
        say("timed out waiting for the jobs")
        return 1

    def summary(self, jobs, states):
        say("summary:")
        ok = True
        for job_id, (name, labels, target) in jobs.items():
            job = states[job_id]
            worker = job["worker_name"] or "-"
            if target == "local":
                right_place = worker.startswith("local")
            else:
                right_place = worker == next(w for w, l in WORKERS if l == labels)
            ok &= job["status"] == "completed" and right_place
            loss = (job["progress"] or {}).get("loss")
            line = f"  {name:18} {job['status']:9} on {worker:18} attempts {job['attempt_count']}"
            if loss is not None:
                line += f"  final loss {loss:.4f}"
            say(line)
        say("every job completed on the worker its labels chose" if ok else "NOT every job completed where expected")
        return 0 if ok else 1


def describe(name, job):
    """Return ``(key, line)``: the line is printed when the key changes (status, worker, each 25 %)."""
    progress = job.get("progress") or {}
    text = f"{name:18} {job['status']:9}"
    if job.get("worker_name"):
        text += f" on {job['worker_name']}"
    bucket = None
    if progress.get("step") is not None and job["status"] == "running":
        bucket = int((progress.get("fraction") or 0) * 4)
        text += f"  {format_progress(progress)}"
    if job["status"] == "queued" and job.get("waiting_reason"):
        text += f"  ({job['waiting_reason']})"
    return (job["status"], job.get("worker_name"), bucket), text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="training steps per job (default 80)")
    parser.add_argument("--step-delay", type=float, default=0.05, help="seconds per step (default 0.05)")
    parser.add_argument("--keep", action="store_true", help="keep the data dir (jobs, checkpoints, logs) afterwards")
    args = parser.parse_args(argv)
    demo = Demo(steps=args.steps, step_delay=args.step_delay, keep=args.keep)
    try:
        return demo.run()
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        demo.stop_all()
        if args.keep:
            say(f"kept {demo.data_dir}")
        else:
            shutil.rmtree(demo.data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
