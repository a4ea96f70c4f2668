"""What a client may send: the limits on its input, the checks that refuse bad input, the cleaning of trainer output.

Two rules, one place each. Text an operator or a worker chooses (names, labels, configs, GPU names)
is refused with a 400 naming the field when it holds a NUL or an unpaired surrogate (neither can be
stored in PostgreSQL), a non-finite number, or too much; a name or label an operator chooses is also
refused when it holds a format control (``name_problem``), and one an agent reports that must not be
refused (a GPU or host name) is shown with its format controls escaped (``format_controls_shown``). Text a trainer produced (a report's
``log_tail``, ``error`` and ``progress``) is arbitrary bytes from a program nobody here controls: it
is cleaned (``clean_text``, ``clean_trainer_json``) and stored, never refused, because refusing a
report loses the log and can leave a job running. The limits an operator may change are settings
(``SIMPLETUNER_MAX_*``, docs/api.md, "Limits"); the rest are the columns' own sizes.
"""

import json
import math
import re
import unicodedata

from django.conf import settings

# --- fixed limits (the database columns and the matching rules) ----------------------------------

GPU_COUNT_MAX = 1024  # GPUs a worker may have and a job may ask for
GPU_VRAM_GB_MAX = 100_000.0
LABEL_KEY_MAX_CHARS = 63
LABEL_VALUE_MAX_CHARS = 200  # a worker's label value, and a job's glob pattern for it
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-/]*$")
NO_NUL_PATTERN = r"^[^\x00]*$"  # the OpenAPI pattern of text that may hold anything but a NUL
LABEL_VALUE_RE = re.compile(r"^[ -~]*$")  # printable ASCII, space included: what the OpenAPI schema declares too
PAGE_SIZE_MAX = 1000  # ?limit= above this is clamped
PAGE_OFFSET_MAX = 2**31 - 1  # ?offset= above this is clamped (past the end: an empty page)
QUERY_PARAM_MAX_CHARS = 200
INT64_MAX = 2**63 - 1

# A trainer's text as stored: a failure's reason, the log tail (its end), keys and strings in its progress.
TRAINER_ERROR_MAX_CHARS = 4000
LOG_TAIL_MAX_CHARS = 16_000
TRAINER_KEY_MAX_CHARS = 100
TRAINER_STRING_MAX_CHARS = 2000
TRAINER_PROGRESS_MAX_BYTES = 64 * 1024

REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")  # NUL, and surrogates (only unpaired ones survive JSON decoding)


def limit(name):
    """Return the operator-configurable limit ``name`` (``MAX_REQUEST_BYTES``, ``MAX_JSON_DEPTH``, ...)."""
    return settings.SIMPLETUNER[name]


# --- text -------------------------------------------------------------------------------------------


def text_problem(text):
    """Return why ``text`` cannot be stored as chosen text (a NUL, an unpaired surrogate), or None."""
    match = _UNSTORABLE.search(text)
    if match is None:
        return None
    return "contains a NUL character" if match.group() == "\x00" else "contains an unpaired surrogate (invalid UTF-16)"


def format_control(text):
    """Return the first format control in ``text`` (Unicode category Cf: the bidirectional overrides and isolates
    U+202A-U+202E and U+2066-U+2069, zero-width characters, tags), or None."""
    return next((char for char in text if unicodedata.category(char) == "Cf"), None)


def name_problem(text):
    """Return why ``text`` cannot be a name or label someone chose (``text_problem``'s reasons, or a format
    control, which can make a name read as another: U+202E shows ``evil\\u202eexe.sh`` as ``evilhs.exe``),
    or None."""
    problem = text_problem(text)
    if problem:
        return problem
    char = format_control(text)
    if char is not None:
        return f"contains the invisible format character U+{ord(char):04X} ({unicodedata.name(char, 'unnamed')}); names may not hold one"
    return None


def format_controls_shown(text):
    """Return ``text`` with each format control written as ``\\uXXXX`` (``\\UXXXXXXXX`` above U+FFFF): how text an
    agent reported (a GPU, host or agent name) is shown, so it cannot reorder or hide what is around it."""
    text = str(text)
    if format_control(text) is None:
        return text
    return "".join(_escaped(char) if unicodedata.category(char) == "Cf" else char for char in text)


def _escaped(char):
    return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}"


def clean_text(text):
    """Return ``text`` with every NUL and unpaired surrogate replaced by U+FFFD (storable everywhere)."""
    return _UNSTORABLE.sub(REPLACEMENT, text)


# --- JSON values a client chose (configs, GPU info, metrics) ----------------------------------------


def json_size(value):
    """Return the size in bytes of ``value`` as compact JSON."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))


def json_depth_exceeds(value, max_depth):
    """Return whether ``value`` nests objects and arrays deeper than ``max_depth`` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def json_problem(value, *, max_depth=None):
    """Return ``"<path>: <why>"`` for the first thing in ``value`` that cannot be stored, or None.

    Refused: nesting deeper than ``max_depth`` (default: the MAX_JSON_DEPTH setting), a key or string
    with a NUL or an unpaired surrogate, a number that is NaN or infinite. The path reads like
    ``config.layers[2].name``.
    """
    max_depth = limit("MAX_JSON_DEPTH") if max_depth is None else max_depth
    if json_depth_exceeds(value, max_depth):
        return f"nested deeper than {max_depth} levels"
    stack = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                key = str(key)
                where = f"{path}.{key}" if path else key
                problem = text_problem(key)
                if problem:
                    return f"{_printable(where)}: the key {problem}"
                stack.append((child, where))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{index}]") for index, child in enumerate(item))
        elif isinstance(item, str):
            problem = text_problem(item)
            if problem:
                return f"{_printable(path) or 'the value'}: {problem}"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{_printable(path) or 'the value'}: {item} is not a number JSON can hold"
    return None


def _printable(path):
    return clean_text(path)[:200]


# --- trainer output ---------------------------------------------------------------------------------


def clean_trainer_json(value, *, depth=None):
    """Return trainer-made JSON ``value`` made storable, never refused.

    Strings and keys are cleaned (``clean_text``) and cut (TRAINER_STRING_MAX_CHARS,
    TRAINER_KEY_MAX_CHARS); NaN, infinities and integers beyond 64 bits become null; anything nested
    deeper than MAX_JSON_DEPTH is dropped. An object still over TRAINER_PROGRESS_MAX_BYTES keeps only
    its top-level numbers, booleans and short strings.
    """
    depth = limit("MAX_JSON_DEPTH") if depth is None else depth
    cleaned = _clean_json(value, depth)
    if isinstance(cleaned, (dict, list)) and json_size(cleaned) > TRAINER_PROGRESS_MAX_BYTES:
        if not isinstance(cleaned, dict):
            return None
        cleaned = {
            key: item
            for key, item in cleaned.items()
            if item is None or isinstance(item, (bool, int, float)) or (isinstance(item, str) and len(item) <= 200)
        }
    return cleaned


def _clean_json(value, depth):
    if isinstance(value, str):
        return clean_text(value[:TRAINER_STRING_MAX_CHARS])
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if -INT64_MAX <= value <= INT64_MAX else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth <= 0:
        return None
    if isinstance(value, dict):
        return {clean_text(str(key)[:TRAINER_KEY_MAX_CHARS]): _clean_json(item, depth - 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean_json(item, depth - 1) for item in value]
    return clean_text(str(value)[:TRAINER_STRING_MAX_CHARS])


# --- labels and label selectors ---------------------------------------------------------------------


def clean_labels(labels, *, what="label"):
    """Return ``labels`` (a worker's labels, or a job's ``worker_labels`` globs) with numbers and booleans
    as strings; raise ValueError saying why they are refused.

    At most MAX_LABELS entries; a key is 1-63 letters, digits, ``_ . - /`` (starting with a letter,
    digit or ``_``); a value (a glob, for a selector) is at most 200 printable ASCII characters.
    """
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise ValueError(f"must be an object mapping a {what} name to a string")
    most = limit("MAX_LABELS")
    if len(labels) > most:
        raise ValueError(f"at most {most} {what}s, got {len(labels)}")
    cleaned = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not key or len(key) > LABEL_KEY_MAX_CHARS or not LABEL_KEY_RE.fullmatch(key):
            raise ValueError(
                f"{what} name {_printable(str(key))[:80]!r} must be 1-{LABEL_KEY_MAX_CHARS} letters, digits or _ . - / "
                "(starting with a letter, digit or _)"
            )
        if isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, (int, float)):
            value = str(value)
        if not isinstance(value, str):
            raise ValueError(f"{what} {key!r} must be a string")
        if len(value) > LABEL_VALUE_MAX_CHARS:
            raise ValueError(f"{what} {key!r} must be at most {LABEL_VALUE_MAX_CHARS} characters, got {len(value)}")
        if not LABEL_VALUE_RE.fullmatch(value):
            raise ValueError(f"{what} {key!r} must hold printable ASCII characters only (no control characters, NUL or newline)")
        cleaned[key] = value
    return cleaned
