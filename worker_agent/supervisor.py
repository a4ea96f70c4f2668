"""The trainer's supervisor: a small process between the agent and its trainer that writes down how the
trainer ended, whatever happens to the agent.

A trainer's result must outlive its agent. The agent journals a result before it reports it
(journal.py), but a trainer can end in the instant before the agent dies (kill -9, OOM killer, a crash):
the agent never learns the exit code, and the job runs again although it completed. So the agent does
not run the trainer itself: it runs this module, which runs the trainer, waits for it, and writes
``<job dir>/exit.json`` (``job_id``, ``attempt``, ``returncode``, ``stopped_by_supervisor``) atomically
the moment the trainer ends. A restarted agent turns an ``exit.json`` that it never settled into a
journaled result (``journal.recover_exits``) and reports it like any other.

The supervisor leads the job's process group (the agent's SIGTERM/SIGKILL to the group reach the
trainer directly; the supervisor itself outlives SIGTERM to write the record) and exits as its trainer
did: the same code, or killed by the same signal. When the agent dies the kernel sends the supervisor
SIGHUP (its parent-death signal); it then stops the trainer (SIGTERM to the group, SIGKILL after the
grace period) and records that it did (``stopped_by_supervisor``), so that a trainer killed because
its agent died is not taken for a trainer that failed.

The parent-death signal can be lost in one window: the agent dies after this process started but before
its handler is in place. With SIGHUP's default action that kills this process before any trainer starts; but
an agent started with SIGHUP ignored (``nohup``, some process managers) passes the ignoring on, and the
signal is dropped. So once its handler is in place the supervisor checks that its parent is still the agent
(``--agent-pid``); if not, it starts no trainer and records that it stopped it.

Run by the agent as ``python -I <this file> --grace S --agent-pid PID -- COMMAND...``: by path and isolated,
so it needs nothing but the standard library (this module imports nothing else) wherever the agent is
installed. Its own messages go to stderr, which is the job's log.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXIT_FILE = "exit.json"  # written by the supervisor when the trainer ends
SETTLED_FILE = "exit.settled.json"  # the same file once the agent has handled that end
FORMAT_VERSION = 1
PARENT_DEATH_SIGNAL = signal.SIGHUP  # how the kernel tells the supervisor that its agent is gone
PR_SET_PDEATHSIG = 1
START_FAILED = 127  # the shell's code for a command that could not be run


def parent_death_signal(sig=signal.SIGTERM):
    """Return a preexec_fn making Linux send ``sig`` to the child when its parent dies, or None elsewhere.

    A trainer whose agent is gone (kill -9 included) can report nothing and its job is requeued
    elsewhere: it must not keep the GPU busy. Linux ties the signal to the *thread* that forked, so
    the child must be spawned by a thread that lives as long as the child (the agent's main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_parent_death_signal():
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return set_parent_death_signal


def write_json_atomically(path, data):
    """Write ``data`` as JSON to ``path``, whole or not at all, and durably (fsynced file and directory).

    A temp file is written and fsynced, renamed over the target, and the directory is fsynced. Raise
    OSError if it cannot be written; the temp file is removed then.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(directory):
    """fsync a directory (a rename in it survives a power cut); never raise."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def exit_record(job_dir):
    """Return the unsettled exit record of ``job_dir`` as a dict, or None (none, or unreadable: logged by the caller)."""
    path = Path(job_dir) / EXIT_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("returncode"), int):
        raise ValueError(f"{path} holds no return code")
    return record


def settle(job_dir):
    """Mark the exit record of ``job_dir`` handled (renamed to ``exit.settled.json``); never raise."""
    path = Path(job_dir) / EXIT_FILE
    try:
        os.replace(path, path.with_name(SETTLED_FILE))
    except OSError:
        return
    fsync_dir(path.parent)


class Supervisor:
    """Run one trainer, stop it if the agent dies, and record how it ended."""

    def __init__(self, command, *, grace, job_dir=".", env=None, agent_pid=None):
        self.command = list(command)
        self.grace = grace
        self.agent_pid = agent_pid  # the agent that started this process: its parent while the agent lives
        self.job_dir = Path(job_dir)
        self.env = os.environ if env is None else env
        self.trainer = None
        self.parent_gone = False  # the parent-death signal came
        self.stopped = False  # SIGTERM sent to the trainer because the agent died
        self.kill_at = None

    def run(self):
        """Run the trainer to its end, write ``exit.json``; return the trainer's Popen return code."""
        # SIGTERM to the group is meant for the trainer: the supervisor stays to write the record. A
        # Python-level handler (not SIG_IGN) is reset by exec, so the trainer keeps the default action.
        signal.signal(signal.SIGTERM, _ignore)
        signal.signal(signal.SIGINT, _ignore)
        signal.signal(PARENT_DEATH_SIGNAL, self._parent_died)
        if self.agent_pid is not None and os.getppid() != self.agent_pid:
            # The agent died before the handler above was in place, and its parent-death signal is lost
            # (ignored, as the agent's own SIGHUP was): no trainer may start for an agent that is gone.
            print("supervisor: the agent is gone before the trainer started; not starting it", file=sys.stderr, flush=True)
            self.parent_gone = self.stopped = True
            self._record(-signal.SIGTERM)
            return -signal.SIGTERM
        try:
            self.trainer = subprocess.Popen(self.command, preexec_fn=parent_death_signal(signal.SIGTERM))
        except OSError as exc:
            print(f"supervisor: cannot start the training command {self.command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            code = START_FAILED
        else:
            if self.parent_gone:  # the agent died while the trainer was being started
                self._stop_trainer()
            code = self._wait()
        self._record(code)
        if self.stopped:
            # The agent is gone and nobody else will clean up: whatever the trainer left behind in the
            # job's group (data loader workers holding GPU memory) goes now, this process with it.
            self._signal_group(signal.SIGKILL)
        return code

    def _wait(self):
        while True:
            timeout = None if self.kill_at is None else max(self.kill_at - time.monotonic(), 0)
            try:
                return self.trainer.wait(timeout)
            except _AgentGone:
                continue  # wait again, now with the grace period as the timeout
            except subprocess.TimeoutExpired:
                print(f"supervisor: trainer still running {self.grace:g}s after SIGTERM; sending SIGKILL", file=sys.stderr)
                self.trainer.kill()
                self.kill_at = None

    def _parent_died(self, signum, frame):
        self.parent_gone = True
        if self.trainer is None or self.trainer.poll() is not None or self.stopped:
            return  # not started yet (run() stops it once started), or ended already: its exit is what it is
        self._stop_trainer()
        raise _AgentGone  # out of a wait without a timeout (a signal does not end it)

    def _stop_trainer(self):
        self.stopped = True
        print("supervisor: the agent is gone; stopping the trainer", file=sys.stderr, flush=True)
        self._signal_group(signal.SIGTERM)
        self.kill_at = time.monotonic() + self.grace

    def _signal_group(self, signum):
        try:
            os.killpg(os.getpgrp(), signum)  # reaches this process too: SIGTERM is ignored above
        except OSError:
            pass

    def _record(self, code):
        record = {
            "version": FORMAT_VERSION,
            "job_id": self.env.get("SIMPLETUNER_JOB_ID", self.job_dir.name),
            "attempt": self.env.get("SIMPLETUNER_ATTEMPT") or None,
            "returncode": code,
            "stopped_by_supervisor": self.stopped,
            "ended_at": time.time(),
        }
        try:
            write_json_atomically(self.job_dir / EXIT_FILE, record)
        except OSError as exc:
            print(f"supervisor: could not write {EXIT_FILE}: {exc}", file=sys.stderr)


class _AgentGone(Exception):
    """Raised by the parent-death signal's handler into the supervisor's wait."""


def _ignore(signum, frame):
    pass


def exit_like(code):
    """Exit this process as the trainer did: ``code``, or killed by signal ``-code``."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)  # the signal is delivered at once; a signal that does not kill falls through
        code = 128 - code
    os._exit(code)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    options = {"--grace": 30.0, "--agent-pid": None}
    while argv[:1] and argv[0] in options and len(argv) > 1:
        options[argv[0]] = float(argv[1]) if argv[0] == "--grace" else int(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: supervisor.py [--grace SECONDS] [--agent-pid PID] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    exit_like(Supervisor(argv, grace=options["--grace"], agent_pid=options["--agent-pid"]).run())


if __name__ == "__main__":
    sys.exit(main())
