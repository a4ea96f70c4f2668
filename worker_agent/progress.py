"""The progress protocol: how a training process tells the agent how far it has got.

A trainer, written in any language, reports progress by printing one line to its standard output
(or standard error: the agent reads both as one stream). The line starts with the marker
``SIMPLETUNER_PROGRESS`` followed by one space, then a JSON object, all on that one line::

    SIMPLETUNER_PROGRESS {"step": 40, "total_steps": 100, "loss": 0.231, "epoch": 1, "metrics": {"accuracy": 0.91}}

Whitespace may come before the marker; a line with anything else before it is ordinary log output.
Every field is optional:

- ``step``: integer >= 0, the number of steps completed.
- ``total_steps``: integer > 0, the number of steps in the whole run.
- ``fraction``: number from 0 to 1, the share of the run done. When it is absent and both ``step``
  and ``total_steps`` are known it is ``step / total_steps``. It is clamped to [0, 1].
- ``epoch``: number >= 0.
- ``loss``: finite number.
- ``learning_rate``: finite number >= 0.
- ``eta_seconds``: finite number >= 0, the trainer's estimate of the time left.
- ``stage``: object, what the trainer is doing now: ``key`` (string, e.g. ``"checkpoint_save"``),
  ``label`` (string, e.g. ``"Saving Checkpoint"``), ``status`` (string: ``running``, ``completed``,
  ``failed``), ``message`` (string), and the stage's own ``current``, ``total`` (numbers >= 0) and
  ``percent`` (0 to 100). Strings are cut to 200 characters; a stage needs a ``key`` or a ``label``.
  A new stage replaces the previous one whole.
- ``metrics``: object mapping a name (at most 64 characters) to a finite number; the first 32
  entries count.
- ``message``: string, cut to 200 characters.

A field with an invalid value (wrong type, out of range, NaN or infinite) is dropped on its own and
the rest of the update still counts; unknown fields are ignored; integers written as ``40.0`` count
as integers. A marker line whose JSON does not parse, is not an object, or has no valid field
carries no update. Updates accumulate: each one overwrites the fields it carries and ``metrics``
merge by name, so a trainer may send, say, only a new loss. An update that moves ``step`` or
``total_steps`` without a ``fraction`` recomputes the fraction from the latest values. Print as
often as you like; the agent forwards the latest state at its own pace. A Python trainer can call
:func:`report` instead of formatting lines.
"""

import json
import math
import sys

from .text import first_line

MARKER = "SIMPLETUNER_PROGRESS "

MAX_MESSAGE_CHARS = 200
MAX_METRICS = 32
MAX_METRIC_NAME_CHARS = 64
CONSOLE_METRICS = 4  # metrics shown in the agent's console line (all of them are reported)
STAGE_TEXT_FIELDS = ("key", "label", "status", "message")
STAGE_NUMBER_FIELDS = ("current", "total")


def _number(value):
    """Return ``value`` as a finite float, or None if it is not a finite JSON number (bools are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _integer(value):
    """Return ``value`` as an int if it is an integral JSON number, else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = _number(value)
    if number is None or not number.is_integer():
        return None
    return int(number)


def _metrics(value):
    if not isinstance(value, dict):
        return None
    metrics = {}
    for name, number in value.items():
        number = _number(number)
        if number is None or not name or len(name) > MAX_METRIC_NAME_CHARS:
            continue
        metrics[name] = number
        if len(metrics) == MAX_METRICS:
            break
    return metrics or None


def _clamp(fraction):
    return min(max(fraction, 0.0), 1.0)


def _text(value):
    """Return ``value`` as one stripped line of at most MAX_MESSAGE_CHARS, or None if it is not a non-blank string."""
    if not isinstance(value, str):
        return None
    value = first_line(value, MAX_MESSAGE_CHARS)
    return value or None


def _stage(value):
    if not isinstance(value, dict):
        return None
    stage = {}
    for name in STAGE_TEXT_FIELDS:
        text = _text(value.get(name))
        if text is not None:
            stage[name] = text
    if "key" not in stage and "label" not in stage:
        return None
    for name in STAGE_NUMBER_FIELDS:
        number = _number(value.get(name))
        if number is not None and number >= 0:
            stage[name] = int(number) if number.is_integer() else number
    percent = _number(value.get("percent"))
    if percent is not None:
        stage["percent"] = min(max(percent, 0.0), 100.0)
    return stage


def normalise(fields):
    """Return the valid protocol fields of ``fields`` (a decoded JSON object), plus ``fraction``.

    Invalid and unknown fields are left out; ``fraction`` is clamped to [0, 1], or computed from
    ``step`` and ``total_steps`` when it is not given.
    """
    update = {}
    step = _integer(fields.get("step"))
    if step is not None and step >= 0:
        update["step"] = step
    total_steps = _integer(fields.get("total_steps"))
    if total_steps is not None and total_steps > 0:
        update["total_steps"] = total_steps
    fraction = _number(fields.get("fraction"))
    if fraction is not None:
        update["fraction"] = _clamp(fraction)
    elif "step" in update and "total_steps" in update:
        update["fraction"] = _clamp(update["step"] / update["total_steps"])
    epoch = _number(fields.get("epoch"))
    if epoch is not None and epoch >= 0:
        update["epoch"] = int(epoch) if epoch.is_integer() else epoch
    loss = _number(fields.get("loss"))
    if loss is not None:
        update["loss"] = loss
    learning_rate = _number(fields.get("learning_rate"))
    if learning_rate is not None and learning_rate >= 0:
        update["learning_rate"] = learning_rate
    eta_seconds = _number(fields.get("eta_seconds"))
    if eta_seconds is not None and eta_seconds >= 0:
        update["eta_seconds"] = eta_seconds
    metrics = _metrics(fields.get("metrics"))
    if metrics is not None:
        update["metrics"] = metrics
    message = _text(fields.get("message"))
    if message is not None:
        update["message"] = message
    stage = _stage(fields.get("stage"))
    if stage is not None:
        update["stage"] = stage
    return update


def parse_line(line):
    """Return the normalised update a progress line carries, or None.

    None when the line (after its trailing newline and leading whitespace) does not start with
    :data:`MARKER`, when its JSON does not parse or is not an object, or when no field is valid.
    Never raises.
    """
    if not isinstance(line, str):
        return None
    line = line.rstrip("\r\n").lstrip()
    if not line.startswith(MARKER):
        return None
    try:
        fields = json.loads(line[len(MARKER) :])
    except (ValueError, RecursionError):
        return None
    if not isinstance(fields, dict):
        return None
    return normalise(fields) or None


def merge(previous, update):
    """Return the progress state after ``update``: its fields overwrite ``previous``'s, metrics by name.

    When ``update`` moves ``step`` or ``total_steps`` without giving a ``fraction``, the fraction is
    recomputed from the merged values. Neither argument is modified.
    """
    merged = dict(previous or {})
    metrics = {**merged.get("metrics", {}), **update.get("metrics", {})}
    merged.update(update)
    if metrics:
        merged["metrics"] = metrics
    if "fraction" not in update and ("step" in update or "total_steps" in update):
        if "step" in merged and "total_steps" in merged:
            merged["fraction"] = _clamp(merged["step"] / merged["total_steps"])
    return merged


def _percent(fraction):
    # Floor, so a run shows 100% only when it is done; the epsilon keeps 0.29 at 29%.
    return f"{int(fraction * 100 + 1e-9)}%"


def _decimal(value):
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.4f}"
    return f"{value:.3e}"


def format_progress(progress):
    """Return a progress state as one console line, e.g. "step 40/100 (40%) epoch 1 loss 0.2310"."""
    parts = []
    step, total_steps, fraction = progress.get("step"), progress.get("total_steps"), progress.get("fraction")
    if step is not None:
        parts.append(f"step {step}/{total_steps}" if total_steps is not None else f"step {step}")
        if fraction is not None:
            parts.append(f"({_percent(fraction)})")
    elif fraction is not None:
        parts.append(_percent(fraction))
    if progress.get("epoch") is not None:
        parts.append(f"epoch {progress['epoch']}")
    if progress.get("loss") is not None:
        parts.append(f"loss {_decimal(progress['loss'])}")
    if progress.get("learning_rate") is not None:
        parts.append(f"lr {progress['learning_rate']:.2e}")
    for name, value in list((progress.get("metrics") or {}).items())[:CONSOLE_METRICS]:
        parts.append(f"{name} {_decimal(value)}")
    if progress.get("eta_seconds") is not None:
        parts.append(f"eta {format_seconds(progress['eta_seconds'])}")
    stage = progress.get("stage")
    if stage:
        parts.append(f"[{format_stage(stage)}]")
    if progress.get("message"):
        parts.append(f"- {progress['message']}")
    return " ".join(parts) if parts else "no progress reported"


def format_seconds(seconds):
    """Return a duration as "42s", "3m05s" or "2h07m"."""
    seconds = int(round(seconds))
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def format_stage(stage):
    """Return a stage as "Saving Checkpoint: running"."""
    name = stage.get("label") or stage.get("key") or "stage"
    return f"{name}: {stage['status']}" if stage.get("status") else name


def _plain(value):
    """Return ``value`` ready for JSON: tensors and numpy scalars as numbers, NaN and infinities as None."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    for convert in (lambda v: v.item(), float):
        try:
            return _plain(convert(value))
        except (AttributeError, TypeError, ValueError):
            continue
    return str(value)


def report(step=None, total_steps=None, *, loss=None, file=None, **fields):
    """Print one progress line for the agent to ``file`` (default: ``sys.stdout``) and flush it.

    ``fields`` are the other protocol fields (``epoch``, ``learning_rate``, ``metrics``,
    ``message``, ``fraction``). Arguments left as None, and NaN or infinite numbers, are not sent;
    tensors and numpy scalars are sent as plain numbers.
    """
    payload = _plain({"step": step, "total_steps": total_steps, "loss": loss, **fields})
    payload = {key: value for key, value in payload.items() if value is not None}
    if isinstance(payload.get("metrics"), dict):
        payload["metrics"] = {name: value for name, value in payload["metrics"].items() if value is not None}
    stream = file if file is not None else sys.stdout
    stream.write(MARKER + json.dumps(payload, separators=(",", ":")) + "\n")
    stream.flush()
