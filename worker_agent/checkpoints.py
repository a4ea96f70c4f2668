"""A trainer's finished checkpoints leave the node as it writes them: the watcher, and the final-step rule.

SimpleTuner marks a checkpoint finished by writing ``checkpoint-<step>/.guard`` containing ``complete``,
last. While the trainer runs, a ``CheckpointWatcher`` thread looks at the output directory every few
hundred milliseconds and uploads each checkpoint so marked, once, whole, its marker last, as a
checkpoint the attempt declares (``protocol.CHECKPOINT_DECLARES_HEADER``), then declares it complete.
It never holds up the trainer or the agent's heartbeats. Checkpoints without the marker are left to
the trainer (the example trainer publishes its own) and to the upload of the output directory when
the trainer exits.

A requeued job whose newest complete checkpoint is its final step (``max_train_steps``) is not
trained again (SimpleTuner would run one step more and overwrite the final weights): the
checkpoint's weight files become the run's output (``result_from_checkpoint``).
"""

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from . import progress as progress_protocol
from . import protocol
from .artifacts import TransferError
from .backoff import Backoff

logger = logging.getLogger(__name__)

GUARD_FILE = ".guard"  # SimpleTuner's checkpoint_manager.CHECKPOINT_GUARD_FILENAME, written last
GUARD_COMPLETE = "complete"
POLL_INTERVAL = 0.3  # seconds between looks at the output directory
MAX_TRAIN_STEPS_KEY = "max_train_steps"
# A checkpoint's weights (the candidates of SimpleTuner's checkpoint_manager.validate_checkpoint: any safetensors
# file, at any depth, and pytorch_model.bin); the rest of a checkpoint is the trainer's state for resuming.
WEIGHT_FILES = frozenset({"pytorch_model.bin"})
WEIGHT_SUFFIXES = (".safetensors",)


def _checkpoint_dirs(output_dir):
    """Return ``[(step, path)]`` of the ``checkpoint-<step>`` directories in ``output_dir``, by step."""
    found = []
    try:
        entries = list(os.scandir(output_dir))
    except OSError:
        return found
    for entry in entries:
        digits = entry.name[len(protocol.CHECKPOINT_PREFIX) :]
        if entry.name.startswith(protocol.CHECKPOINT_PREFIX) and digits.isascii() and digits.isdigit() and entry.is_dir():
            found.append((int(digits), Path(entry.path)))
    return sorted(found)


def guard_stamp(directory):
    """Return the ``mtime_ns`` of ``directory``'s marker when it says ``complete``, else None."""
    guard = Path(directory) / GUARD_FILE
    try:
        stamp = guard.stat().st_mtime_ns
        text = guard.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return stamp if text.strip() == GUARD_COMPLETE else None


def finished_checkpoints(output_dir):
    """Return ``{step: (path, marker stamp)}`` of the checkpoints in ``output_dir`` marked complete."""
    finished = {}
    for step, path in _checkpoint_dirs(output_dir):
        stamp = guard_stamp(path)
        if stamp is not None:
            finished[step] = (path, stamp)
    return finished


class CheckpointWatcher:
    """Uploads each checkpoint the trainer marks complete in ``output_dir``, in a thread of its own.

    Checkpoints already marked when it starts (the one resumed from, or an earlier attempt's on this
    node) are not uploaded again unless rewritten. ``stop()`` takes a last look (a checkpoint finished
    just before the trainer ended still goes) and returns once the thread has ended.
    """

    def __init__(self, *, job_id, output_dir, transfer, manifest_path, interval=POLL_INTERVAL, backoff=None, clock=time.monotonic):
        self.job_id = job_id
        self.output_dir = Path(output_dir)
        self.transfer = transfer
        self.manifest_path = manifest_path
        self.interval = interval
        self.backoff = backoff or Backoff(base=2.0, cap=60.0)
        self._clock = clock
        self._seen = {step: stamp for step, (_, stamp) in finished_checkpoints(self.output_dir).items()}
        self._retry_at = None  # after a transient failure: when to try again
        self._dead = False  # the orchestrator refused this attempt's token: nothing more can be stored
        self._stop = threading.Event()
        self._thread = None
        self.uploaded = []  # the steps uploaded and declared complete, in order

    def start(self):
        self._thread = threading.Thread(target=self._run, name=f"job-{self.job_id}-checkpoints", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        """Stop watching after one last look; return once done."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _run(self):
        while not self._stop.wait(self.interval):
            self.scan()
        self._retry_at = None  # the last look tries whatever is left
        self.scan()

    def scan(self):
        """Upload the checkpoints marked complete since the last look, oldest first."""
        if self._dead or (self._retry_at is not None and self._clock() < self._retry_at):
            return
        for step, (path, stamp) in finished_checkpoints(self.output_dir).items():
            if self._seen.get(step) == stamp:
                continue
            if not self._upload(step, path, stamp):
                return

    def _upload(self, step, path, stamp):
        """Upload one checkpoint; return False to stop this look (a transient failure, or a dead token)."""
        started = time.monotonic()
        try:
            sent = self.transfer.upload_checkpoint(path, step, manifest_path=self.manifest_path, last=(GUARD_FILE,))
        except TransferError as exc:
            if exc.status is None:  # unreachable after the transfer's own retries: try again later
                self._retry_at = self._clock() + self.backoff.next_delay()
                logger.warning("job %s: %s not uploaded yet (%s); trying again later", self.job_id, path.name, exc)
                return False
            self._seen[step] = stamp
            if exc.code == protocol.STALE_ATTEMPT or exc.status == 401:
                self._dead = True
                logger.warning("job %s: %s not uploaded: %s", self.job_id, path.name, exc)
                return False
            logger.error("job %s: %s could not be uploaded: %s", self.job_id, path.name, exc)
            return True
        except OSError as exc:  # the trainer removed it meanwhile (checkpoints_total_limit)
            self._seen[step] = stamp
            logger.warning("job %s: %s changed while it was uploaded (%s); skipped", self.job_id, path.name, exc)
            return True
        self._seen[step] = stamp
        self._retry_at = None
        self.backoff.reset()
        self.uploaded.append(step)
        logger.info(
            "job %s: %s uploaded (%d file(s) in %.1fs) and declared complete", self.job_id, path.name, sent, time.monotonic() - started
        )
        return True


# --- a job whose last checkpoint is its final step ---------------------------------------------------


def _config_value(config, name):
    for key in (name, f"--{name}"):
        if key in config:
            return config[key]
    return None


def final_step(config):
    """Return the run's last step, the config's ``max_train_steps`` when it is a whole number > 0, else None."""
    value = _config_value(config or {}, MAX_TRAIN_STEPS_KEY)
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return int(number) if number.is_integer() and number > 0 else None


def reaches_final_step(config, step):
    """Return True when a checkpoint of ``step`` is the run's end: training from it again would pass it."""
    last = final_step(config)
    return last is not None and step is not None and int(step) >= last


def result_from_checkpoint(checkpoint_dir, output_dir):
    """Copy the weight files of ``checkpoint_dir`` into ``output_dir`` at the same relative paths (where a
    finished run leaves its final weights); return those paths, sorted."""
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    copied = []
    for path in sorted(p for p in checkpoint_dir.rglob("*") if p.is_file() and not p.is_symlink()):
        if path.name not in WEIGHT_FILES and not path.name.endswith(WEIGHT_SUFFIXES):
            continue
        relative = path.relative_to(checkpoint_dir)
        target = output_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(relative.as_posix())
    return copied


def adopt_final_checkpoint(job_id, resume, output_dir):
    """Make ``resume`` (a ``protocol.ResumeCheckpoint`` of the run's final step, downloaded into ``output_dir``)
    the run's result, as ``result_from_checkpoint`` does; return the output lines that say so (bytes), the
    last one a progress line at that step."""
    step, name = resume["step"], resume["checkpoint"]
    copied = result_from_checkpoint(Path(output_dir) / name, output_dir)
    note = (
        f"{name} is this run's final step (max_train_steps): not trained again; "
        f"its weights are the result ({', '.join(copied) or 'no weight file found'})"
    )
    logger.info("job %s: %s", job_id, note)
    return [note.encode(), (progress_protocol.MARKER + json.dumps({"step": step, "total_steps": step})).encode()]
