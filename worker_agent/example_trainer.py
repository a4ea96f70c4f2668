"""A small real trainer for demos and tests: logistic regression by mini-batch SGD, standard library only.

``python -m worker_agent.example_trainer`` reads the job's JSON config from the file named by
``CONFIG_PATH`` (as the agent runs any trainer), learns to separate two noisy Gaussian blobs made
from ``seed``, reports progress with :func:`worker_agent.progress.report`, and writes
``checkpoint.json`` into the job directory: ``output_dir`` from the config when given (created if
missing; relative to the working directory), else the directory holding the config file. Every
``checkpoint_every`` steps it writes ``checkpoint-<step>/checkpoint.json`` there (SimpleTuner's layout)
and, when the agent passed an upload endpoint and token, publishes it (``example_publish``); with
``resume_from_checkpoint`` naming such a directory it continues from that step.

Config keys (each also accepted as ``--name``, as SimpleTuner writes them; others are ignored):
``max_train_steps`` (100), ``learning_rate`` (0.1), ``seed`` (42), ``train_batch_size`` (32),
``checkpoint_every`` (25 steps; 0 writes only the final checkpoint), ``output_dir``,
``resume_from_checkpoint`` (a checkpoint directory's name in ``output_dir``), and for demos
and tests ``step_delay`` (seconds to pause after each step, 0) and ``fail_at_step`` (fail with exit
code 3 when that step is reached).

Exit codes: 0 done; 1 the checkpoint could not be written; 2 no usable config (or checkpoint to
resume from); 3 ``fail_at_step``;
143 / 130 stopped by SIGTERM / SIGINT at a step boundary, after saving a checkpoint.
"""

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading

from . import protocol
from .example_publish import PublishError, Publisher
from .progress import report

DATASET_SIZE = 512
CHECKPOINT_NAME = "checkpoint.json"
LOG_EVERY = 10

# name -> (type, default, lowest allowed value)
CONFIG_KEYS = {
    "max_train_steps": (int, 100, 0),
    "learning_rate": (float, 0.1, 0.0),
    "seed": (int, 42, None),
    "train_batch_size": (int, 32, 1),
    "checkpoint_every": (int, 25, 0),
    "step_delay": (float, 0.0, 0.0),
    "fail_at_step": (int, None, None),
    "output_dir": (str, None, None),
    "resume_from_checkpoint": (str, None, None),
}


class ConfigError(Exception):
    """The config file is missing, unreadable or holds an unusable value."""


def _coerce(name, kind, value, lowest):
    """Return ``value`` as ``kind`` (numbers may be given as strings); raise ConfigError if it is not one."""
    if kind is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name} must be a non-empty string, not {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name} must be a number, not {value!r}")
    try:
        number = float(value)
        if kind is int:
            if not number.is_integer():
                raise ValueError
            number = int(number)
    except (ValueError, OverflowError):
        raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a number'}, not {value!r}") from None
    if kind is float and not math.isfinite(number):
        raise ConfigError(f"{name} must be finite, not {value!r}")
    if lowest is not None and number < lowest:
        raise ConfigError(f"{name} must be at least {lowest}, not {value!r}")
    return number


def parse_config(raw):
    """Return the trainer's settings from a decoded config object, defaults filled in.

    Keys may be written ``name`` or ``--name``; unknown keys are ignored, a None value means the
    default. Raise ConfigError for a value of the wrong type or out of range.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a JSON object, not {type(raw).__name__}")
    values = {key[2:] if key.startswith("--") else key: value for key, value in raw.items()}
    config = {}
    for name, (kind, default, lowest) in CONFIG_KEYS.items():
        value = values.get(name)
        config[name] = default if value is None else _coerce(name, kind, value, lowest)
    if config["learning_rate"] <= 0:
        raise ConfigError(f"learning_rate must be greater than 0, not {config['learning_rate']!r}")
    return config


def load_config(path):
    """Return the settings in the JSON file at ``path``; raise ConfigError if it cannot be used."""
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    return parse_config(raw)


def make_dataset(seed, size=DATASET_SIZE):
    """Return ``size`` points ``(x1, x2, label)``: two Gaussian blobs (sd 1) around (-1, -1) and (1, 1)."""
    rng = random.Random(seed)
    points = []
    for index in range(size):
        label = index % 2
        centre = 1.0 if label else -1.0
        points.append((rng.gauss(centre, 1.0), rng.gauss(centre, 1.0), label))
    rng.shuffle(points)
    return points


def init_weights(seed):
    """Return the starting weights ``[w1, w2, bias]``: small, drawn from ``seed``."""
    rng = random.Random(f"weights-{seed}")
    return [rng.uniform(-0.1, 0.1) for _ in range(3)]


def _logit(weights, point):
    return weights[0] * point[0] + weights[1] * point[1] + weights[2]


def sigmoid(z):
    """Return the logistic function of ``z`` without overflowing for large ``|z|``."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _softplus(z):
    """Return log(1 + e^z) without overflowing."""
    return max(z, 0.0) + math.log1p(math.exp(-abs(z)))


def loss_and_accuracy(weights, points):
    """Return the mean binary cross-entropy of ``weights`` on ``points`` and the share classified right."""
    total_loss = 0.0
    correct = 0
    for point in points:
        z = _logit(weights, point)
        # -log(sigmoid(z)) for label 1, -log(1 - sigmoid(z)) for label 0.
        total_loss += _softplus(-z) if point[2] else _softplus(z)
        correct += (z >= 0) == bool(point[2])
    return total_loss / len(points), correct / len(points)


def gradient(weights, points):
    """Return the gradient of the mean cross-entropy with respect to ``[w1, w2, bias]``."""
    grad = [0.0, 0.0, 0.0]
    for point in points:
        error = sigmoid(_logit(weights, point)) - point[2]
        grad[0] += error * point[0]
        grad[1] += error * point[1]
        grad[2] += error
    return [g / len(points) for g in grad]


def sgd_step(weights, points, learning_rate):
    """Return the weights after one gradient-descent step on the batch ``points``."""
    return [w - learning_rate * g for w, g in zip(weights, gradient(weights, points), strict=True)]


def iterate_batches(points, batch_size, seed):
    """Yield ``(epoch, batch)`` forever: each epoch (from 1) is a fresh shuffle of ``points`` cut into batches."""
    rng = random.Random(f"batches-{seed}")
    order = list(points)
    epoch = 0
    while True:
        epoch += 1
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield epoch, order[start : start + batch_size]


def write_checkpoint(directory, state):
    """Write ``state`` as JSON to ``directory/checkpoint.json`` atomically; return the path.

    The file is written beside its destination and renamed over it, so a reader sees the old
    checkpoint or the new one, never half of one.
    """
    path = os.path.join(directory, CHECKPOINT_NAME)
    descriptor, temporary = tempfile.mkstemp(prefix=".checkpoint.", suffix=".tmp", dir=directory)
    try:
        os.chmod(temporary, 0o644)  # mkstemp makes it private; a checkpoint is an ordinary output file
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(state, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return path


class StopRequest:
    """Set by SIGTERM or SIGINT; training stops at the next step boundary, cutting a ``step_delay`` short."""

    def __init__(self):
        self._event = threading.Event()
        self.signum = None

    def __call__(self, signum, frame=None):
        self.signum = signum
        self._event.set()

    def is_set(self):
        return self._event.is_set()

    def wait(self, timeout):
        """Wait up to ``timeout`` seconds; return True as soon as a stop is requested."""
        return self._event.wait(timeout)


def _log(text):
    print(text, flush=True)


def load_resume(config, job_dir):
    """Return the state in ``job_dir/<resume_from_checkpoint>/checkpoint.json``, or None when not resuming.

    Raise ConfigError when it is missing, unreadable or of another seed.
    """
    name = config["resume_from_checkpoint"]
    if not name:
        return None
    path = os.path.join(job_dir, name, CHECKPOINT_NAME)
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
        step, weights = int(state["step"]), [float(w) for w in state["weights"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot resume from {path}: {exc}") from None
    if state.get("seed") != config["seed"] or len(weights) != 3:
        raise ConfigError(f"cannot resume from {path}: it is not a checkpoint of this run (seed {state.get('seed')})")
    return {**state, "step": step, "weights": weights}


def train(config, job_dir, stop, resume=None, publisher=None):
    """Run the training loop with ``config`` (from :func:`parse_config`), checkpointing into ``job_dir``,
    from ``resume`` (a checkpoint's state) when given; publish step checkpoints with ``publisher``.

    Return the process exit code: 0 when all steps ran, 3 at ``fail_at_step``, 128 + the signal
    number when ``stop`` was requested, 1 if a checkpoint cannot be written.
    """
    total = config["max_train_steps"]
    seed = config["seed"]
    learning_rate = config["learning_rate"]
    points = make_dataset(seed)
    weights = init_weights(seed)
    batches = iterate_batches(points, config["train_batch_size"], seed)
    step = epoch = 0
    if resume is not None:
        weights, step, epoch = resume["weights"], min(resume["step"], total), resume.get("epoch", 0)
        for _ in range(step):  # the same batches as an uninterrupted run would see from here
            epoch, _batch = next(batches)
        _log(f"resumed from checkpoint-{step} at step {step}")
    loss, accuracy = loss_and_accuracy(weights, points)

    def save(directory=job_dir):
        state = {
            "model": "logistic_regression",
            "step": step,
            "total_steps": total,
            "epoch": epoch,
            "loss": loss,
            "accuracy": accuracy,
            "seed": seed,
            "learning_rate": learning_rate,
            "weights": weights,
            "complete": step == total,
        }
        try:
            os.makedirs(directory, exist_ok=True)
            return write_checkpoint(directory, state)
        except OSError as exc:
            print(f"error: cannot write checkpoint in {directory}: {exc}", file=sys.stderr, flush=True)
            return None

    def save_step():
        directory = os.path.join(job_dir, f"{protocol.CHECKPOINT_PREFIX}{step}")
        if save(directory) is None:
            return False
        _log(f"checkpoint saved at step {step}")
        if publisher is not None:
            try:
                publisher.publish_checkpoint(directory, step)
                _log(f"checkpoint-{step} published")
            except PublishError as exc:
                print(f"warning: checkpoint-{step} not published: {exc}", file=sys.stderr, flush=True)
        return True

    _log(
        f"example trainer: logistic regression on {len(points)} points, {total} steps, "
        f"batch {config['train_batch_size']}, lr {learning_rate}, seed {seed}, checkpoints in {job_dir}"
    )
    report(step, total or None, loss=loss, learning_rate=learning_rate, metrics={"accuracy": accuracy})
    while step < total:
        if stop.is_set():
            break
        if config["fail_at_step"] is not None and step + 1 == config["fail_at_step"]:
            print(f"error: simulated failure at step {step + 1} (fail_at_step)", file=sys.stderr, flush=True)
            return 3
        epoch, batch = next(batches)
        weights = sgd_step(weights, batch, learning_rate)
        step += 1
        loss, accuracy = loss_and_accuracy(weights, points)
        report(step, total, loss=loss, epoch=epoch, learning_rate=learning_rate, metrics={"accuracy": accuracy})
        if step % LOG_EVERY == 0 or step == total:
            _log(f"step {step}/{total} loss {loss:.4f} acc {accuracy:.3f}")
        if config["checkpoint_every"] and step % config["checkpoint_every"] == 0 and step < total:
            if not save_step():
                return 1
        if config["step_delay"] and step < total:
            stop.wait(config["step_delay"])
    if save() is None:
        return 1
    if stop.is_set() and step < total:
        _log(f"stopped by signal at step {step}; checkpoint saved")
        return 128 + stop.signum
    _log(f"training complete: step {step}, loss {loss:.4f}, accuracy {accuracy:.3f}")
    return 0


def _install_handlers(stop):
    """Route SIGTERM and SIGINT to ``stop``; return the previous handlers (none off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}


def main(argv=None):
    """Train with the config at ``$CONFIG_PATH``; return the exit code (see the module docstring)."""
    argparse.ArgumentParser(
        prog="python -m worker_agent.example_trainer",
        description="Train a small logistic-regression model with the JSON config at $CONFIG_PATH.",
    ).parse_args(argv)
    path = os.environ.get("CONFIG_PATH")
    try:
        if not path:
            raise ConfigError("CONFIG_PATH is not set (it must name the job's JSON config file)")
        config = load_config(path)
        job_dir = os.path.abspath(config["output_dir"] or os.path.dirname(os.path.abspath(path)))
        try:
            os.makedirs(job_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create output_dir {job_dir}: {exc}") from None
        resume = load_resume(config, job_dir)
    except ConfigError as exc:
        print(f"example_trainer: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = StopRequest()
    previous = _install_handlers(stop)
    try:
        return train(config, job_dir, stop, resume, Publisher.from_environment())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
