"""The chaos soak: a real fleet under kill -9 and SIGTERM, then an audit of lost and twice-completed jobs.

``python -m tests.soak.soak --seed N --jobs J --agents A --packed-agents P --duration S [--short]``
(``make soak``, ``make soak-short``) starts a scratch PostgreSQL database, a private ``redis-server``, one
orchestrator (``simpletuner server``), a Celery worker and Celery beat (the sweeps), and A agents (``python -m
worker_agent``): P of them packing agents (``--gpus 0,1,2,3``: four declared GPU slots, up to four jobs at
once), the others running one job at a time (most persistent, some ephemeral). Their trainer
(``tests/soak/trainer.py``) appends one line per completed run to an append-only ledger. It submits J jobs
through the operator API (with packing agents, each needing 1 or 2 GPUs or the whole worker, drawn from the
seed; about one in eight, ``--gang-share``, drawn from a stream of its own, a two-node job: ``num_nodes`` 2, the
whole worker on each node, whose trainer runs once per member with its rank), then for S seconds follows a chaos
plan drawn from ``random.Random(seed)``: kill -9 of an agent (restarted 1-10 s later), SIGTERM of an agent
(restarted once it has exited), kill -9 of the orchestrator (restarted 1-3 s later). Meanwhile it reads, twice a
second, where the database places every job, GPU and gang member, and checks each
read (``tests.soak.audit.placement_findings``); every trainer also records its start and end in a runs file.
Then it stops the chaos, lets the fleet drain (with a deadline) and audits the database, the ledger and the
runs (``tests.soak.audit``; a gang job completes once when one attempt completed every rank, and no member
(job, attempt, rank) may run twice). Exit status: 0 when nothing was lost, nothing completed twice and nothing
is inconsistent; 1 otherwise; 2 when the soak itself could not run. Every process it started is stopped
on the way out, Ctrl-C and SIGTERM included; the scratch database is dropped. The run's directory (every
process's log, the ledger, the runs file, and the database's jobs, attempts, gang members, workers and audit rows
as CSV) is kept when the audit fails, or with ``--keep``.
"""

import argparse
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import psutil
import psycopg

from worker_agent import protocol
from worker_agent.runner import parent_death_signal

from ..e2e.agent_harness import AgentRunner, write_import_blocker
from ..e2e.harness import REPO_ROOT, Fleet, HarnessError, Orchestrator, create_database, drop_database, stop_process
from ..e2e.redis_harness import RedisServer, redis_server_binary
from .audit import ACTIVE, audit, is_gang, packs, parse_ledger, placement_findings, stamp, trainer_runs

# Audit actions (audit/actions.py; the soak reads the database directly, without Django).
JOB_COMPLETION_RECOVERED = "job.completion_recovered"
JOB_STATUS_CHANGED = "job.status_changed"
TRAINER = Path(__file__).resolve().with_name("trainer.py")
TRAINER_COMMAND = shlex.join([sys.executable, str(TRAINER)])
TIMERS = {
    "SIMPLETUNER_HEARTBEAT_INTERVAL": "1",
    "SIMPLETUNER_HEARTBEAT_TIMEOUT": "6",
    "SIMPLETUNER_HEALTH_CHECK_INTERVAL": "1",
    "SIMPLETUNER_DISPATCH_ACK_TIMEOUT": "5",
}
DEFAULT_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/postgres"
CONFIG_NAME = "soak"
AGENT_KILL9, AGENT_SIGTERM, ORCHESTRATOR_KILL9 = "agent kill -9", "agent SIGTERM", "orchestrator kill -9"
# Per profile: orchestrator kills, mean seconds between agent actions, drain deadline (seconds). The short drain
# allows 60 s: the two-node jobs take two one-job workers at once, only once no one-node job waits for those
# (no worker is held for a gang), so most run one after another at the end (20-47 s of drain in seeds 1-8).
PROFILES = {"short": (1, 3.0, 60.0), "long": (3, 5.0, 180.0)}
AGENT_RESTART_S = (1.0, 10.0)
ORCHESTRATOR_RESTART_S = (1.0, 3.0)
SIGTERM_EXIT_DEADLINE_S = 30.0
START_DEADLINE_S = 60.0
TICK_S = 0.2
PROGRESS_EVERY_S = 10.0
SNAPSHOT_EVERY_S = 0.5
EVIDENCE_JOBS = 10
# A packing agent's GPUs (declared slots: this machine has no NVIDIA GPU), and the GPUs a job needs when the
# fleet has packing agents: 1 or 2 of them, or None (no gpu_count: the whole worker), drawn with these weights.
PACKED_GPUS = "0,1,2,3"
GPU_NEEDS = (1, 2, None)
GPU_NEED_WEIGHTS = (2, 1, 1)
# The rows the audit reads (audit.audit's jobs and workers).
JOB_FIELDS = ("status", "last_error", "worker_id", "gpu_count", "gpu_indices", "holds_gpus", "num_nodes", "lease_id")
WORKER_FIELDS = ("name", "status", "current_job_id", "gang_rank", "max_jobs", "gpu_slots", "gpus_free")
MEMBER_FIELDS = ("job_id", "lease_id", "rank", "worker_id", "gpu_indices", "outcome")  # and holds_gpus, where it exists
# What a kept run's directory gets of its scratch database (Soak.dump), as CSV.
DUMPED_TABLES = ("queue_job", "queue_jobattempt", "queue_gangmember", "workers_worker", "audit_auditevent")
# Multi-node jobs: the share of the jobs submitted with num_nodes GANG_NODES (drawn from the seed, a stream of its
# own), each needing the whole worker on each node (no gpu_count: the one-job agents here have no GPU).
GANG_SHARE = 0.125
GANG_NODES = 2


class SoakError(RuntimeError):
    """The soak itself could not run (a service did not start): no verdict on the product."""


@dataclass(frozen=True)
class Chaos:
    """One planned action: at ``at`` seconds into the chaos, ``kind`` on agent slot ``slot``, back after ``delay`` s."""

    at: float
    kind: str
    slot: int | None
    delay: float


def chaos_plan(rng, *, duration, slots, orchestrator_kills, mean_gap):
    """Return the chaos actions of one run, in time order, drawn only from ``rng``.

    Orchestrator kills fall one in each of ``orchestrator_kills`` equal windows of the middle 80% of
    ``duration``, each with one agent kill -9 while it is down or just back (when agents hold results
    they could not report yet); the other agent actions (kill -9 twice as often as SIGTERM) follow
    each other every ``mean_gap`` seconds on average.
    """
    plan = []
    window = 0.8 * duration / max(orchestrator_kills, 1)
    for index in range(orchestrator_kills):
        start = 0.1 * duration + index * window
        at, down = rng.uniform(start, start + 0.6 * window), rng.uniform(*ORCHESTRATOR_RESTART_S)
        plan.append(Chaos(at, ORCHESTRATOR_KILL9, None, down))
        if slots:
            plan.append(Chaos(rng.uniform(at, at + down + 2.0), AGENT_KILL9, rng.randrange(slots), rng.uniform(*AGENT_RESTART_S)))
    at = rng.uniform(0.5, mean_gap)
    while at < duration and slots:
        kind = rng.choices((AGENT_KILL9, AGENT_SIGTERM), weights=(2, 1))[0]
        delay = rng.uniform(*AGENT_RESTART_S) if kind == AGENT_KILL9 else 0.0
        plan.append(Chaos(at, kind, rng.randrange(slots), delay))
        at += rng.uniform(0.3 * mean_gap, 1.7 * mean_gap)
    return sorted(plan, key=lambda action: action.at)


class Log:
    """Prints timestamped lines (UTC time, seconds since the start) and keeps them in the run's log file."""

    def __init__(self):
        self.started = time.monotonic()
        self.file = None

    def say(self, message):
        line = f"{stamp(time.time())} +{time.monotonic() - self.started:7.2f}s  {message}"
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()


class AgentSlot:
    """One worker and the successive agent processes that serve it (each with its own log, one work dir)."""

    def __init__(self, worker, persistent, work_dir, packed=False):
        self.worker = worker
        self.persistent = persistent
        self.packed = packed  # a packing agent (--gpus PACKED_GPUS): several jobs at once
        self.work_dir = work_dir
        self.agent = None
        self.incarnation = 0
        self.state = "down"  # up | stopping (SIGTERM sent) | down (restart_at)
        self.restart_at = 0.0
        self.stop_deadline = 0.0

    @property
    def name(self):
        kind = "packing" if self.packed else "persistent" if self.persistent else "ephemeral"
        return f"{self.worker.name} ({kind})"


class Soak:
    """One soak run: its services and agents, the chaos, the drain, the audit and the tear-down."""

    def __init__(self, args, log):
        self.args = args
        self.log = log
        self.rng = random.Random(args.seed)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"simpletuner-soak-{args.seed}-"))
        self.ledger = self.run_dir / "ledger.jsonl"
        self.runs = self.run_dir / "runs.jsonl"  # every trainer's start and end (trainer.py)
        self.postgres_url = args.postgres_url
        self.redis = None
        self.database_url = None
        self.orch = None
        self.celery = []  # (name, Popen)
        self.runner = None
        self.fleet = None
        self.slots = []
        self.job_ids = []
        self.gpu_needs = Counter()  # jobs by the GPUs they were submitted with (None: the whole worker)
        self.gang_jobs = 0  # jobs submitted with num_nodes GANG_NODES
        self.member_fields = MEMBER_FIELDS  # with holds_gpus where queue_gangmember has it (start)
        self.members = []  # the gang members read last (placement)
        self.gang_snapshots = 0  # snapshots where a multi-node job was dispatched or running
        self.db = None
        self.snapshots = 0  # consistent reads of the placement checked while the soak ran
        self.snapshot_seen = {}  # (subject, why) -> [snapshots it was seen in, first seen (epoch), the rows then]
        self.most_held = {}  # packing worker name -> the most jobs it held at once in a snapshot
        self.shared_snapshots = 0  # snapshots where some packing worker held two jobs or more
        self.placed_trainers = 0  # completed trainers given GPUs (their CUDA_VISIBLE_DEVICES checked)
        self.trainer_runs = 0  # trainer runs with a start and an end line (checked for overlaps)
        self.open_runs = []  # trainer runs with no end line (killed by SIGKILL): not checked
        self.all_runs = []
        self.most_running = {}  # worker name -> the most of its trainers that ran at once (the runs file)
        self.kills = Counter()
        self.events = Counter()  # respawns and other things worth a line in the summary
        self.chaos_log = []  # (epoch, text)
        self.orchestrator_state = "up"  # up | down (restart_at)
        self.orchestrator_restart_at = 0.0

    # --- set-up -------------------------------------------------------------------------------------

    def start(self):
        args = self.args
        self.log.say(f"run directory {self.run_dir} (logs, ledger)")
        if args.redis_url:
            redis_url = args.redis_url
        elif redis_server_binary():
            self.redis = RedisServer(self.run_dir / "redis").start()
            redis_url = self.redis.url
        else:
            raise SoakError(
                "redis-server is not installed: install it, or pass --redis-url (or set SOAK_REDIS_URL), "
                "e.g. redis://127.0.0.1:6379/14"
            )
        self.database_url = create_database(self.postgres_url)
        self.log.say(f"scratch database {self.database_url.rsplit('/', 1)[-1]}, Redis {redis_url}")
        self.orch = Orchestrator(
            backend="postgres",
            data_dir=self.run_dir / "orchestrator",
            database_url=self.database_url,
            redis_url=redis_url,
            via_cli=True,
            extra_env=TIMERS,
        )
        try:
            self.orch.start()
        except HarnessError as exc:
            raise SoakError(f"the orchestrator did not start: {exc}") from None
        self.log.say(f"orchestrator (simpletuner server, pid {self.orch.process.pid}) at {self.orch.base_url}")
        self._start_celery()
        self.db = psycopg.connect(self.database_url, autocommit=True, connect_timeout=10)
        holds = self.db.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_name = 'queue_gangmember' AND column_name = 'holds_gpus'"
        ).fetchone()
        self.member_fields = (*MEMBER_FIELDS, "holds_gpus") if holds else MEMBER_FIELDS
        self.fleet = fleet = Fleet(self.orch, "soak")
        blocker = write_import_blocker(self.run_dir / "blocker")
        self.runner = AgentRunner(self.orch, fleet, self.run_dir / "agents", blocker_dir=blocker)
        ephemeral = args.ephemeral
        for index in range(args.agents):  # the packing agents first (persistent), the ephemeral ones last
            packed, persistent = index < args.packed_agents, index < args.agents - ephemeral
            kind = "persistent" if persistent else "ephemeral"
            worker = fleet.create_worker(labels={"pool": fleet.tag}, worker_type=kind)
            slot = AgentSlot(worker, persistent, self.run_dir / "agents" / worker.name / "jobs", packed=packed)
            self.slots.append(slot)
            self._spawn_agent(slot)
        for slot in self.slots:
            try:
                self.runner.wait_ready(slot.agent)
            except AssertionError as exc:
                raise SoakError(f"agent {slot.name} did not connect: {exc}") from None
        self.log.say(
            f"{len(self.slots)} agents connected ({args.packed_agents} packing with --gpus {PACKED_GPUS}, "
            f"{ephemeral} ephemeral); trainer {TRAINER_COMMAND}"
        )

    def _start_celery(self):
        env = self.orch.env()
        schedule = self.run_dir / "orchestrator" / "celerybeat-schedule"
        commands = {
            "celery-worker": [
                "worker", "--pool", "solo", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                "--without-heartbeat", "--hostname", f"soak-{secrets.token_hex(4)}@%h",
            ],
            "celery-beat": ["beat", "--loglevel", "INFO", "--schedule", str(schedule)],
        }  # fmt: skip
        ready = {"celery-worker": " ready.", "celery-beat": "beat: Starting"}
        for name, tail in commands.items():
            log_path = self.run_dir / f"{name}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "simpletuner_site.celery", *tail],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=parent_death_signal(signal.SIGKILL),
                )
            self.celery.append((name, process))
            deadline = time.monotonic() + START_DEADLINE_S
            while ready[name] not in log_path.read_text(errors="replace"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SoakError(f"{name} did not start:\n{log_path.read_text(errors='replace')[-4000:]}")
                time.sleep(0.2)
            self.log.say(f"{name} (pid {process.pid}) ready")

    def _spawn_agent(self, slot):
        slot.incarnation += 1
        args = [
            "--orchestrator-url", self.orch.base_url,
            "--name", slot.worker.name,
            "--work-dir", str(slot.work_dir),
            "--command", TRAINER_COMMAND,
        ]  # fmt: skip
        if slot.persistent:
            args.append("--persistent")
        if slot.packed:
            args += ["--gpus", PACKED_GPUS]
        slot.agent = self.runner.spawn(
            args,
            label=f"{slot.worker.name}/{slot.incarnation}",
            # A trainer sees CUDA_VISIBLE_DEVICES only from its placement (the audit compares it with its attempt's).
            env=self.runner.env(SIMPLETUNER_WORKER_TOKEN=slot.worker.token, CUDA_VISIBLE_DEVICES=None),
            work_dir=slot.work_dir,
            worker=slot.worker,
        )
        slot.state = "up"
        return slot.agent

    def submit(self):
        config = {
            "soak_seed": self.args.seed,
            "ledger": str(self.ledger),
            "runs": str(self.runs),
            "min_seconds": self.args.trainer_seconds[0],
            "max_seconds": self.args.trainer_seconds[1],
        }
        # Their own streams of the seed: the chaos plan of a seed is the same with or without packing agents or gangs.
        needs = random.Random(f"{self.args.seed}:gpu_count")
        gangs = random.Random(f"{self.args.seed}:num_nodes")
        for _ in range(self.args.jobs):
            labels = {"pool": self.fleet.tag}  # every soak worker has it
            body = {"config_name": CONFIG_NAME, "config": config, "worker_labels": labels}
            # Without packing agents, no gpu_count: the one-job workers here have no GPU (gpu_count 0).
            need = needs.choices(GPU_NEEDS, weights=GPU_NEED_WEIGHTS)[0] if self.args.packed_agents else None
            if gangs.random() < self.args.gang_share:
                body["num_nodes"] = GANG_NODES  # the whole worker on each node: any agent of ours may be a member
                self.gang_jobs += 1
            else:
                if need is not None:
                    body["gpu_count"] = need
                self.gpu_needs[need] += 1
            answer = self.fleet.submit(body)
            self.job_ids.append(answer["job_id"])
        needs_text = ", ".join(f"{n} x {gpu_need_label(need)}" for need, n in sorted(self.gpu_needs.items(), key=_need_order))
        gangs_text = f", {self.gang_jobs} x {GANG_NODES} nodes (the whole worker on each)" if self.gang_jobs else ""
        self.log.say(f"submitted {len(self.job_ids)} jobs through POST /api/queue/submit ({needs_text}{gangs_text})")

    # --- chaos --------------------------------------------------------------------------------------

    def chaos(self, action, now):
        """Carry out one planned action (on the next live agent after the planned one, if that one is down)."""
        if action.kind == ORCHESTRATOR_KILL9:
            if self.orchestrator_state != "up":
                return self.note(f"skip {action.kind}: the orchestrator is {self.orchestrator_state}")
            pid = self.orch.process.pid
            self.orch.kill()
            self.orchestrator_state = "down"
            self.orchestrator_restart_at = now + action.delay
            self.kills[action.kind] += 1
            return self.note(f"CHAOS kill -9 orchestrator (pid {pid}); restart in {action.delay:.1f}s")
        order = self.slots[action.slot :] + self.slots[: action.slot]
        slot = next((candidate for candidate in order if candidate.state == "up"), None)
        if slot is None:
            return self.note(f"skip {action.kind}: no agent is up")
        agent = slot.agent
        if action.kind == AGENT_KILL9:
            agent.kill()
            slot.state, slot.restart_at = "down", now + action.delay
            self.kills[action.kind] += 1
            return self.note(f"CHAOS kill -9 agent {slot.name} (pid {agent.pid}); restart in {action.delay:.1f}s")
        agent.terminate()
        slot.state, slot.stop_deadline = "stopping", now + SIGTERM_EXIT_DEADLINE_S
        self.kills[action.kind] += 1
        return self.note(f"CHAOS SIGTERM agent {slot.name} (pid {agent.pid}); restart once it exits")

    def note(self, text):
        self.chaos_log.append((time.time(), text))
        self.log.say(text)

    def tick(self, now):
        """Restart what is due, notice agents that exited; raise SoakError if the orchestrator cannot restart.

        Processes are started from this (the main) thread: their parent-death signal is tied to the
        thread that forked them.
        """
        if self.orchestrator_state == "down" and now >= self.orchestrator_restart_at:
            try:
                self.orch.restart()  # returns once it answers the API (the chaos waits those seconds)
            except HarnessError as exc:
                raise SoakError(f"the orchestrator did not restart: {exc}") from None
            self.orchestrator_state = "up"
            self.note(f"orchestrator answers again (pid {self.orch.process.pid})")
        for slot in self.slots:
            code = slot.agent.process.poll() if slot.agent is not None else None
            if slot.state == "up" and code is not None:
                if not slot.persistent and code == 0:
                    self.events["ephemeral agent exited 0 after its job: started again"] += 1
                    self.log.say(f"agent {slot.name} (pid {slot.agent.pid}) did its one job and exited 0; starting another")
                else:
                    self.events["agent exited by itself (not signalled), restarted"] += 1
                    self.note(f"agent {slot.name} (pid {slot.agent.pid}) exited by itself with {code}; restarting it")
                self._spawn_agent(slot)
            elif slot.state == "stopping":
                if code is not None:
                    self.note(f"agent {slot.name} (pid {slot.agent.pid}) exited {code} after SIGTERM; restarting it")
                    self._spawn_agent(slot)
                elif now >= slot.stop_deadline:
                    self.events[f"agent still running {SIGTERM_EXIT_DEADLINE_S:g}s after SIGTERM: killed"] += 1
                    self.note(f"agent {slot.name} (pid {slot.agent.pid}) runs {SIGTERM_EXIT_DEADLINE_S:g}s after SIGTERM: kill -9")
                    slot.agent.kill()
                    self._spawn_agent(slot)
            elif slot.state == "down" and now >= slot.restart_at:
                self._spawn_agent(slot)
                self.log.say(f"agent {slot.name} restarted (pid {slot.agent.pid})")

    def run_chaos(self):
        plan = chaos_plan(
            self.rng,
            duration=self.args.duration,
            slots=len(self.slots),
            orchestrator_kills=self.args.orchestrator_kills,
            mean_gap=self.args.mean_gap,
        )
        counts = Counter(action.kind for action in plan)
        kinds = ", ".join(f"{n} x {kind}" for kind, n in sorted(counts.items()))
        self.log.say(f"chaos for {self.args.duration:g}s: plan of {len(plan)} actions: {kinds}")
        start = time.monotonic()
        next_progress = start + PROGRESS_EVERY_S
        next_snapshot = start
        pending = list(plan)
        while True:
            now = time.monotonic()
            while pending and now - start >= pending[0].at:
                self.chaos(pending.pop(0), now)
            self.tick(now)
            if now - start >= self.args.duration:
                break
            if now >= next_progress:
                self.progress()
                next_progress = now + PROGRESS_EVERY_S
            if now >= next_snapshot:
                self.snapshot()
                next_snapshot = now + SNAPSHOT_EVERY_S
            time.sleep(TICK_S)
        self.log.say("chaos over: no more kills; restarts still due go ahead")

    # --- placement snapshots ------------------------------------------------------------------------

    def placement(self):
        """Return ``(jobs, workers)``, the rows ``audit`` takes, read in one REPEATABLE READ transaction with the
        gang members of those jobs (kept as ``members``)."""
        with self.db.transaction():
            self.db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            jobs = self.rows("queue_job", JOB_FIELDS, "WHERE config_name = %s", (CONFIG_NAME,))
            workers = self.rows("workers_worker", WORKER_FIELDS)
            fields = self.member_fields
            cursor = self.db.execute(
                f"SELECT {', '.join(f'm.{name}' for name in fields)} FROM queue_gangmember m "
                "JOIN queue_job j ON j.id = m.job_id WHERE j.config_name = %s ORDER BY m.id",
                (CONFIG_NAME,),
            )
            self.members = [dict(zip(fields, row, strict=True)) for row in cursor]
        return jobs, workers

    def rows(self, table, fields, where="", params=()):
        """Return ``{id: {field: value}}`` of ``table``'s rows (``where``), each with ``fields``."""
        cursor = self.db.execute(f"SELECT id, {', '.join(fields)} FROM {table} {where}", params)
        return {row[0]: dict(zip(fields, row[1:], strict=True)) for row in cursor}

    def snapshot(self):
        """Check one consistent read of the placement (``placement_findings``); remember what it found, and how
        many jobs each packing worker held."""
        jobs, workers = self.placement()
        self.snapshots += 1
        held = Counter(job["worker_id"] for job in jobs.values() if job["holds_gpus"])
        for worker_id, worker in workers.items():
            if packs(worker):
                self.most_held[worker["name"]] = max(self.most_held.get(worker["name"], 0), held[worker_id])
        self.shared_snapshots += any(n >= 2 for n in held.values())
        self.gang_snapshots += any(is_gang(job) and job["status"] in ACTIVE for job in jobs.values())
        for finding in placement_findings(jobs, workers, self.members):
            seen = self.snapshot_seen.get(finding)
            if seen is None:
                self.snapshot_seen[finding] = [1, time.time(), describe_placement(finding[0], jobs, workers, self.members)]
                self.log.say(f"PLACEMENT {finding[0]}: {finding[1]}")
            else:
                seen[0] += 1

    def snapshot_findings(self):
        """The findings of the snapshots, as ``audit`` takes them (each once, saying when and how often)."""
        return [
            (subject, f"{why} (in {n} of {self.snapshots} reads while the soak ran, first at {stamp(first)})")
            for (subject, why), (n, first, _rows) in self.snapshot_seen.items()
        ]

    # --- drain --------------------------------------------------------------------------------------

    def statuses(self):
        rows = self.db.execute(
            "SELECT status, count(*) FROM queue_job WHERE config_name = %s GROUP BY status", (CONFIG_NAME,)
        ).fetchall()
        return Counter(dict(rows))

    def progress(self):
        counts = self.statuses()
        lines = len(self.ledger.read_text().splitlines()) if self.ledger.exists() else 0
        order = ("queued", "dispatched", "running", "completed", "failed", "cancelled")
        self.log.say("jobs: " + ", ".join(f"{s} {counts.get(s, 0)}" for s in order) + f"; ledger lines {lines}")

    def drain(self):
        """Wait until every job is finished, no worker is busy and every restart is done, or the deadline passes."""
        deadline = time.monotonic() + self.args.drain_timeout
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while True:
            now = time.monotonic()
            self.tick(now)
            settled = self.orchestrator_state == "up" and all(slot.state == "up" for slot in self.slots)
            if settled:
                counts = self.statuses()
                busy = self.db.execute("SELECT count(*) FROM workers_worker WHERE status = 'busy'").fetchone()[0]
                if sum(counts[s] for s in ("queued", "dispatched", "running")) == 0 and busy == 0:
                    self.log.say(f"drained in {now - (deadline - self.args.drain_timeout):.1f}s")
                    return True
            if now >= deadline:
                self.log.say(f"drain deadline ({self.args.drain_timeout:g}s) passed with work left")
                return False
            if now >= next_progress:
                self.progress()
                next_progress = now + PROGRESS_EVERY_S
            self.snapshot()
            time.sleep(0.5)

    # --- audit --------------------------------------------------------------------------------------

    def trainers_alive(self):
        """Return ``"pid N (job dir)"`` for each trainer process of this run still alive."""
        found = []
        for process in psutil.process_iter(["pid", "cmdline", "cwd", "status"]):
            info = process.info
            if info["status"] == psutil.STATUS_ZOMBIE or str(TRAINER) not in (info["cmdline"] or []):
                continue
            if (info["cwd"] or "").startswith(str(self.run_dir)):
                found.append(f"pid {info['pid']} in {info['cwd']}")
        return found

    def audit(self):
        # A trainer the agent was stopping when the queue emptied may need a moment to go.
        deadline = time.monotonic() + 5
        stray = self.trainers_alive()
        while stray and time.monotonic() < deadline:
            time.sleep(0.2)
            stray = self.trainers_alive()
        jobs, workers = self.placement()
        completed, attempt_gpus = {}, {}
        attempts = self.db.execute(
            "SELECT job_id, lease_id, gpu_indices FROM queue_jobattempt WHERE outcome = 'completed'"
        )
        for job_id, lease, gpu_indices in attempts:
            completed.setdefault(job_id, []).append(lease)
            job = jobs.get(job_id)
            # What its trainer must have seen: the GPUs it was given; nothing for a job given the whole worker.
            placed = gpu_indices is not None and job is not None and job["gpu_count"]
            attempt_gpus[lease] = ",".join(str(index) for index in gpu_indices) if placed else None
        outcomes = dict(self.db.execute("SELECT lease_id, outcome FROM queue_jobattempt"))
        records, bad = parse_ledger(self.ledger.read_text() if self.ledger.exists() else "")
        self.placed_trainers = sum(1 for record in records if record.get("cuda_visible_devices"))
        run_records, bad_runs = parse_ledger(self.runs.read_text() if self.runs.exists() else "")
        runs, self.open_runs = trainer_runs(run_records)
        self.trainer_runs = len(runs)
        self.all_runs = runs + self.open_runs
        names = {worker_id: worker["name"] for worker_id, worker in workers.items()}
        self.most_running = {names.get(worker_id, worker_id): n for worker_id, n in most_at_once(runs).items()}
        result = audit(
            submitted_ids=self.job_ids,
            jobs=jobs,
            workers=workers,
            completed_attempts=completed,
            ledger=records,
            bad_ledger_lines=bad,
            stray_trainers=stray,
            attempt_gpus=attempt_gpus,
            snapshot_findings=self.snapshot_findings(),
            runs=runs,
            open_runs=self.open_runs,
            bad_runs_lines=bad_runs,
            members=self.members,
            attempt_outcomes=outcomes,
        )
        # Completions that survived their agent: reported from its journal after a restart (to a job still
        # running there, or late, to a job requeued meanwhile), and late completions of lost attempts.
        journal, late = self.db.execute(
            "SELECT count(*) FILTER (WHERE details->>'reason' LIKE %(journal)s OR details->>'journal' = 'true'), "
            "count(*) FILTER (WHERE action = %(late)s) FROM audit_auditevent "
            "WHERE action = %(late)s OR (action = %(changed)s AND details->>'to' = 'completed')",
            {"journal": f"%{protocol.FROM_JOURNAL}%", "late": JOB_COMPLETION_RECOVERED, "changed": JOB_STATUS_CHANGED},
        ).fetchone()
        recovered = {"completions reported from an agent's journal": journal, "late completions of lost attempts kept": late}
        return result, records, recovered

    def evidence(self, result, records):
        """Print the rows behind each placement finding of the snapshots, then, for the first flagged jobs, their
        attempts, audit rows, ledger lines and nearby chaos."""
        for (subject, why), (n, first, rows) in list(self.snapshot_seen.items())[:EVIDENCE_JOBS]:
            print(f"\n--- evidence: {subject}: {why} (first read at {stamp(first)}, seen {n} times) ---")
            for row in rows:
                print(f"  {row}")
        for job_id in result.flagged_jobs()[:EVIDENCE_JOBS]:
            print(f"\n--- evidence: job {job_id} ---")
            attempts = self.db.execute(
                "SELECT number, lease_id, worker_name, dispatched_at, started_at, finished_at, outcome, error "
                "FROM queue_jobattempt WHERE job_id = %s ORDER BY number",
                (job_id,),
            ).fetchall()
            times = []
            for number, lease, worker, dispatched, started, finished, outcome, error in attempts:
                times += [t.timestamp() for t in (dispatched, started, finished) if t is not None]
                print(
                    f"  attempt {number} {lease} on {worker}: dispatched {_t(dispatched)} started {_t(started)} "
                    f"finished {_t(finished)} outcome {outcome or '(pending)'} {error[:100]}"
                )
            for record in records:
                if record["job_id"] == job_id:
                    times.append(record["time"])
                    rank = "" if record.get("rank") is None else f" rank {record['rank']}"
                    print(
                        f"  ledger: trainer of attempt {record.get('attempt')}{rank} (pid {record.get('pid')}) "
                        f"completed at {stamp(record['time'])} in {record.get('job_dir')}"
                    )
            for run in self.all_runs:
                if run["job_id"] == job_id:
                    end = "(no end line)" if run["end"] is None else stamp(run["end"])
                    rank = "" if run.get("rank") is None else f" rank {run['rank']}"
                    print(
                        f"  trainer run of attempt {run['attempt']}{rank} on worker {run['worker_id']} GPUs {run['gpus']}: "
                        f"{stamp(run['start'])} to {end}"
                    )
            for member in self.members:
                if member["job_id"] == job_id:
                    print(f"  gang member {member}")
            for created, action, actor, details in self.db.execute(
                "SELECT created_at, action, actor_name, details FROM audit_auditevent WHERE target_id = %s ORDER BY id",
                (job_id,),
            ):
                print(f"  audit {_t(created)} {action} by {actor}: {str(details)[:160]}")
            if times:
                low, high = min(times) - 3, max(times) + 3
                for epoch, text in self.chaos_log:
                    if low <= epoch <= high:
                        print(f"  chaos {stamp(epoch)} {text}")

    def dump(self):
        """Write the tables the audit read (and the attempts and audit rows) as CSV into the run's directory, so a
        kept run can be studied after its scratch database is dropped."""
        folder = self.run_dir / "database"
        folder.mkdir(exist_ok=True)
        for table in DUMPED_TABLES:
            with open(folder / f"{table}.csv", "wb") as out, self.db.cursor().copy(
                f"COPY (SELECT * FROM {table} ORDER BY 1) TO STDOUT WITH CSV HEADER"
            ) as copy:
                for chunk in copy:
                    out.write(chunk)
        self.log.say(f"tables {', '.join(DUMPED_TABLES)} written to {folder}")

    # --- tear-down ----------------------------------------------------------------------------------

    def stop(self):
        """Stop everything this soak started (each step on its own: one failure does not skip the rest)."""
        steps = [
            ("agents", self._stop_agents),
            ("celery", self._stop_celery),
            ("orchestrator", lambda: self.orch and self.orch.stop()),
            ("redis", lambda: self.redis and self.redis.stop()),
            ("database connection", lambda: self.db and self.db.close()),
            ("scratch database", lambda: self.database_url and drop_database(self.postgres_url, self.database_url)),
        ]
        for name, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                print(f"soak: stopping {name} failed: {exc!r}", file=sys.stderr, flush=True)

    def _stop_agents(self):
        for slot in self.slots:
            if slot.agent is not None:
                slot.agent.kill()
        for line in self.trainers_alive():  # their parent-death signal normally ends them already
            pid = int(line.split()[1])
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass

    def _stop_celery(self):
        for _name, process in self.celery:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            stop_process(process)
            try:
                os.killpg(process.pid, signal.SIGKILL)  # anything the group left behind
            except ProcessLookupError:
                pass


def _t(value):
    return "-" if value is None else stamp(value.timestamp())


def most_at_once(runs):
    """Return ``{worker_id: the most of its runs (trainer_runs) that were running at one moment}``."""
    edges = defaultdict(list)
    for run in runs:
        edges[run["worker_id"]] += [(run["start"], 1), (run["end"], -1)]
    most = {}
    for worker_id, moments in edges.items():
        running = 0
        for _, step in sorted(moments):  # an end before a start at the same instant
            running += step
            most[worker_id] = max(most.get(worker_id, 0), running)
    return most


def gpu_need_label(need):
    return "the whole worker" if need is None else f"{need} GPU{'s' if need > 1 else ''}"


def _need_order(item):
    return (item[0] is None, item[0] or 0)


def describe_placement(subject, jobs, workers, members=()):
    """Return the rows a placement finding about ``subject`` (a job or worker id) rests on: the worker, every job
    placed on it or holding its GPUs, and the gang members of those jobs and of the worker, as they were read."""
    worker_id = subject if subject in workers else (jobs.get(subject) or {}).get("worker_id")
    worker = workers.get(worker_id)
    if worker is None:
        rows, shown = [f"job {subject}: {jobs.get(subject)}"], {subject}
    else:
        rows, shown = [f"worker {worker_id}: {worker}"], {subject, worker.get("current_job_id")}
        for job_id, job in sorted(jobs.items()):
            if job["worker_id"] == worker_id and (job["holds_gpus"] or job["status"] in ("dispatched", "running")):
                rows.append(f"job {job_id}: {job}")
                shown.add(job_id)
        shown.update(member["job_id"] for member in members if member["worker_id"] == worker_id)
    for member in members:
        if member["job_id"] in shown:
            holder = workers.get(member["worker_id"]) or {}
            rows.append(f"gang member {member} (its worker: current job {holder.get('current_job_id')}, rank {holder.get('gang_rank')})")
    return rows


def print_summary(args, soak, result, recovered, wall):
    status = result.by_status
    rows = [
        ("seed", args.seed),
        ("jobs submitted", result.submitted),
        ("completed", status.get("completed", 0)),
        ("failed (with a reason)", status.get("failed", 0) - sum(why == "failed without a reason" for _, why in result.lost)),
        ("cancelled", status.get("cancelled", 0)),
        ("queued at the end", status.get("queued", 0)),
        ("dispatched at the end", status.get("dispatched", 0)),
        ("running at the end", status.get("running", 0)),
        ("ledger lines (trainers completed)", result.ledger_lines),
        *((f"jobs needing {gpu_need_label(need)}", n) for need, n in sorted(soak.gpu_needs.items(), key=_need_order)),
        *result.gangs.items(),
        ("reads with a multi-node job placed", soak.gang_snapshots),
        ("completed trainers given GPUs", soak.placed_trainers),
        ("trainer runs checked for overlaps", soak.trainer_runs),
        ("trainer runs with no end (not checked)", len(soak.open_runs)),
        ("placement reads checked", soak.snapshots),
        ("reads with a packing worker holding 2+ jobs", soak.shared_snapshots),
        *((f"most jobs held at once: {name}", n) for name, n in sorted(soak.most_held.items())),
        *((f"most trainers run at once: {name}", n) for name, n in sorted(soak.most_running.items())),
        ("LOST", len(result.lost)),
        ("COMPLETED TWICE", len(result.twice)),
        ("late duplicates (C, by design: one result kept)", len(result.late_duplicates)),
        ("INCONSISTENT", len(result.inconsistent)),
        *((f"kills: {kind}", soak.kills.get(kind, 0)) for kind in (AGENT_KILL9, AGENT_SIGTERM, ORCHESTRATOR_KILL9)),
        *recovered.items(),
        ("wall time to the audit (s)", f"{wall:.1f}"),
    ]
    width = max(len(label) for label, _ in rows)
    print(
        f"\n===== soak audit: seed {args.seed}, {args.jobs} jobs, {args.agents} agents ({args.packed_agents} packing), "
        f"{args.duration:g}s chaos ====="
    )
    for label, value in rows:
        print(f"  {label:<{width}}  {value:>8}")
    for reason, n in result.failed_reasons.most_common():
        print(f"  failed x {n}: {reason}")
    for label, n in sorted(soak.events.items()):
        print(f"  note x {n}: {label}")
    findings_by_title = (
        ("lost", result.lost), ("completed twice", result.twice), ("inconsistent", result.inconsistent),
        ("late duplicate (C)", result.late_duplicates),
    )
    for title, findings in findings_by_title:
        for subject, why in findings[:50]:
            print(f"  {title}: {subject}: {why}")
        if len(findings) > 50:
            print(f"  {title}: ... and {len(findings) - 50} more")
    verdict = "PASS" if result.passed else "FAIL"
    print(f"  result: {verdict} (lost {len(result.lost)}, twice {len(result.twice)}, inconsistent {len(result.inconsistent)})")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.soak.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="seed of every random choice (default: a random one, printed)")
    parser.add_argument("--jobs", type=int, default=60, help="jobs to submit (default 60)")
    parser.add_argument("--agents", type=int, default=4, help="agents (default 4; a quarter of them ephemeral)")
    parser.add_argument(
        "--packed-agents",
        type=int,
        help=f"how many of the agents are packing agents (--gpus {PACKED_GPUS}, persistent; default: half of them)",
    )
    parser.add_argument(
        "--ephemeral", type=int, help="how many of the other agents are ephemeral (default: a quarter of all, at most the others)"
    )
    parser.add_argument(
        "--gang-share",
        type=float,
        default=GANG_SHARE,
        help=f"share of the jobs submitted with num_nodes {GANG_NODES} (default %(default)s; 0: none)",
    )
    parser.add_argument("--duration", type=float, default=45, help="seconds of chaos (default 45)")
    parser.add_argument("--short", action="store_true", help="the CI profile: 1 orchestrator kill, 60 s drain deadline")
    parser.add_argument("--orchestrator-kills", type=int, help="orchestrator kill -9s (default: 1 short, 3 long)")
    parser.add_argument("--mean-gap", type=float, help="mean seconds between agent actions (default: 3 short, 5 long)")
    parser.add_argument("--drain-timeout", type=float, help="drain deadline in seconds (default: 60 short, 180 long)")
    parser.add_argument(
        "--trainer-seconds", type=float, nargs=2, default=(0.5, 3.0), metavar=("MIN", "MAX"), help="trainer run time (0.5 3)"
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("DATABASE_URL", "").strip() or DEFAULT_POSTGRES_URL,
        help="PostgreSQL server to make the scratch database on (default: DATABASE_URL, else %(default)s)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SOAK_REDIS_URL") or None,
        help="Redis to use, e.g. redis://127.0.0.1:6379/14 (default: SOAK_REDIS_URL, else a private redis-server)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory even when the audit passes")
    args = parser.parse_args(argv)
    kills, gap, drain = PROFILES["short" if args.short else "long"]
    args.orchestrator_kills = kills if args.orchestrator_kills is None else args.orchestrator_kills
    args.mean_gap = gap if args.mean_gap is None else args.mean_gap
    args.drain_timeout = drain if args.drain_timeout is None else args.drain_timeout
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
    if not args.postgres_url.startswith(("postgres://", "postgresql://")):
        parser.error(f"--postgres-url must be a PostgreSQL URL, got {args.postgres_url.split(':', 1)[0]}")
    if args.jobs < 1 or args.agents < 1 or args.duration <= 0 or args.trainer_seconds[0] > args.trainer_seconds[1]:
        parser.error("--jobs and --agents must be >= 1, --duration > 0, and MIN <= MAX")
    if not 0 <= args.gang_share <= 1 or (args.gang_share and args.agents < GANG_NODES):
        parser.error(f"--gang-share must be from 0 to 1, and multi-node jobs need {GANG_NODES} agents or more")
    args.packed_agents = args.agents // 2 if args.packed_agents is None else args.packed_agents
    if not 0 <= args.packed_agents <= args.agents:
        parser.error(f"--packed-agents must be from 0 to --agents ({args.agents})")
    others = args.agents - args.packed_agents
    if args.ephemeral is None:
        args.ephemeral = min(args.agents // 4 if args.agents >= 2 else 0, others)
    if not 0 <= args.ephemeral <= others:
        parser.error(f"--ephemeral must be from 0 to the agents that do not pack ({others})")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    args = parse_args(argv)
    print(f"soak: seed {args.seed}", flush=True)
    started = time.monotonic()
    log = Log()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a shell may start us ignoring it
        signal.signal(signum, _interrupt)
    soak = Soak(args, log)
    log.file = open(soak.run_dir / "soak.log", "w")  # noqa: SIM115 - closed below
    log.say(
        f"seed {args.seed}: {args.jobs} jobs, {args.agents} agents ({args.packed_agents} packing), {args.duration:g}s of chaos, "
        f"{args.orchestrator_kills} orchestrator kill(s), drain deadline {args.drain_timeout:g}s, timers "
        + " ".join(f"{k.removeprefix('SIMPLETUNER_').lower()}={v}s" for k, v in TIMERS.items())
    )
    code, keep = 2, True
    try:
        soak.start()
        soak.submit()
        soak.run_chaos()
        soak.drain()
        soak.progress()
        result, records, recovered = soak.audit()
        print_summary(args, soak, result, recovered, time.monotonic() - started)
        if not result.passed:
            soak.evidence(result, records)
        code, keep = (0, args.keep) if result.passed else (1, True)
        if keep:
            soak.dump()
    except SoakError as exc:
        print(f"soak: could not run: {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr, flush=True)
        code = 130
    except Exception:  # noqa: BLE001 - the soak broke, not the product: exit 2, not 1
        traceback.print_exc()
    finally:
        soak.stop()
        log.file.close()
        if keep:
            print(f"soak: logs and ledger kept in {soak.run_dir}", flush=True)
        else:
            shutil.rmtree(soak.run_dir, ignore_errors=True)
    print(f"soak: seed {args.seed}, exit {code}, wall time {time.monotonic() - started:.1f}s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
