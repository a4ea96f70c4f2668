"""The soak's trainer: sleeps a seeded while, reports progress, then appends one line to the completion ledger.

The agent runs it as it runs any trainer (``CONFIG_PATH``, ``SIMPLETUNER_JOB_ID``, ``SIMPLETUNER_ATTEMPT``
in its environment). The config names the ledger file and the seed: the run lasts
``uniform(min_seconds, max_seconds)`` drawn from ``"<seed>:<job id>"`` (the same for every attempt of a
job), printed as ``SIMPLETUNER_PROGRESS`` steps. Its very last act is one ``write()`` of one JSON line
``{"job_id", "attempt", "pid", "time", "job_dir", "cuda_visible_devices"}`` (the GPUs the agent gave it, None
when unset) and, for a member of a multi-node job, its rank and rendezvous as the agent set them
(``worker_agent.runner.placement_env``: ``rank`` from ``NODE_RANK``, ``nnodes``, ``master_addr``, ``master_port``;
None each for a one-node job) to the ledger, opened ``O_APPEND`` and fsynced, then
exit 0: a ledger line is a trainer that completed, and the soak's audit counts them per job. SIGTERM
(the agent stopping it, or its agent's death) ends it at once with no line, as it would a real run.

When the config names a ``runs`` file, the trainer also appends a ``{"event": "start", ...}`` line there
(its job, attempt, rank and rendezvous, pid, time, job dir and ``CUDA_VISIBLE_DEVICES``) before it runs, and an ``{"event": "end"}``
line (pid, attempt, time, ``how``: ``completed`` or ``signal``) when it ends, so the soak can tell which
trainers ran at the same time on one worker and GPU (``audit.gpu_overlaps``). SIGTERM then writes the end line
and ends the process by the same signal, as before; a SIGKILL leaves the run without an end.

The line and the exit 0 are one step: SIGTERM is blocked before the line is written and the process
ends with ``os._exit(0)`` right after, so a trainer that wrote its line always exits 0 (a signal in
between would otherwise make a completed run look killed: the agent's contract is the exit code).
"""

import json
import os
import random
import signal
import sys
import time

from worker_agent import protocol
from worker_agent.progress import report

STEPS = 10


def append_line(path, record):
    """Append ``record`` as one JSON line to ``path`` with a single write, and fsync it."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"short write to the ledger: {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


def member():
    """Return this run's part of a multi-node job as the agent's environment says (``protocol.GANG_ENV``): ``rank``
    (``NODE_RANK``), ``nnodes``, ``master_addr``, ``master_port``; each None when unset (a one-node job)."""
    env = {name: os.environ.get(name) for name in protocol.GANG_ENV.values()}
    number = {name: int(value) if value not in (None, "") else None for name, value in env.items() if name != "MASTER_ADDR"}
    return {
        "rank": number["NODE_RANK"], "nnodes": number["NNODES"],
        "master_addr": env["MASTER_ADDR"], "master_port": number["MASTER_PORT"],
    }  # fmt: skip


def record_runs(path, job_id, attempt):
    """Append this run's start line to the runs file ``path``, and make SIGTERM append its end line before it
    ends the process (by SIGTERM, as it would without this)."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    job_dir = os.environ.get("SIMPLETUNER_JOB_DIR", "")
    start = {"event": "start", "job_id": job_id, "attempt": attempt, **member(), "pid": os.getpid(), "time": time.time()}
    append_line(path, {**start, "job_dir": job_dir, "cuda_visible_devices": devices})

    def stopped(signum, frame):
        append_line(path, run_end(job_id, attempt, "signal"))
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)


def run_end(job_id, attempt, how):
    return {"event": "end", "job_id": job_id, "attempt": attempt, "pid": os.getpid(), "time": time.time(), "how": how}


def main():
    with open(os.environ["CONFIG_PATH"], encoding="utf-8") as handle:
        config = json.load(handle)
    job_id = os.environ["SIMPLETUNER_JOB_ID"]
    rng = random.Random(f"{config['soak_seed']}:{job_id}")
    seconds = rng.uniform(float(config["min_seconds"]), float(config["max_seconds"]))
    attempt = os.environ.get("SIMPLETUNER_ATTEMPT") or None
    runs = config.get("runs")
    if runs:
        record_runs(runs, job_id, attempt)
    print(f"soak trainer: job {job_id} attempt {attempt} runs {seconds:.2f}s", flush=True)
    for step in range(1, STEPS + 1):
        time.sleep(seconds / STEPS)
        report(step, STEPS, loss=1.0 / step)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # the commit: line + exit 0
    append_line(
        config["ledger"],
        {
            "job_id": job_id,
            "attempt": attempt,
            **member(),
            "pid": os.getpid(),
            "time": time.time(),
            "job_dir": os.environ.get("SIMPLETUNER_JOB_DIR", ""),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
    )
    if runs:
        append_line(runs, run_end(job_id, attempt, "completed"))
    os._exit(0)  # at once: no interpreter teardown between the line and the exit


if __name__ == "__main__":
    sys.exit(main())
