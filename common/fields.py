"""Serializer fields for everything a client sends: each with a declared bound, each refusal a 400 naming the field.

Every input serializer of the API uses these (a test checks it): chosen text and JSON are refused when
they cannot be stored (``common.inputs``), a trainer's text and JSON are cleaned and kept.
"""

from django.core.validators import ProhibitNullCharactersValidator
from rest_framework import serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from .inputs import clean_text, clean_trainer_json, json_problem, json_size, limit


class BoundedText(serializers.CharField):
    """A string of at most ``max_length`` characters; a NUL or an unpaired surrogate is refused (DRF's own checks)."""

    def __init__(self, *, max_length, **kwargs):
        super().__init__(max_length=max_length, **kwargs)


class BoundedInt(serializers.IntegerField):
    """An integer in ``[min_value, max_value]``: both bounds are required."""

    def __init__(self, *, min_value, max_value, **kwargs):
        super().__init__(min_value=min_value, max_value=max_value, **kwargs)


class BoundedFloat(serializers.FloatField):
    """A finite number in ``[min_value, max_value]``: both bounds are required."""

    def __init__(self, *, min_value, max_value, **kwargs):
        super().__init__(min_value=min_value, max_value=max_value, **kwargs)


class BoundedJSON(serializers.JSONField):
    """Any JSON value of the given ``types`` (e.g. ``(dict,)``), at most ``max_bytes``: a number, or the name of
    a limit setting (default: MAX_REQUEST_BYTES).

    Refused, with the path inside the value: a NUL or unpaired surrogate in a key or string, NaN or
    infinity, nesting deeper than MAX_JSON_DEPTH.
    """

    def __init__(self, *, types=(dict, list, str, int, float, bool), max_bytes=None, **kwargs):
        self.types = types
        self.max_bytes = max_bytes
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        problem = json_problem(data)  # before DRF's own check, which refuses NaN without saying where
        if problem:
            raise serializers.ValidationError(problem)
        data = super().to_internal_value(data)
        if data is None:
            return data
        if not isinstance(data, self.types) or (isinstance(data, bool) and bool not in self.types):
            raise serializers.ValidationError(f"{self.field_name or 'the value'} must be {_kinds(self.types)}")
        most = self.max_bytes if isinstance(self.max_bytes, int) else limit(self.max_bytes or "MAX_REQUEST_BYTES")
        size = json_size(data)
        if size > most:
            raise serializers.ValidationError(f"at most {most} bytes of JSON, got {size}")
        return data


class TrainerText(serializers.CharField):
    """Text a trainer produced (a failure's reason): NUL and unpaired surrogates replaced, cut to ``max_length``.

    Never refused for its content or length: losing a result is worse than a cut reason.
    """

    def __init__(self, *, max_length, **kwargs):
        super().__init__(**kwargs)
        self.cut_at = max_length
        self.validators = [
            v for v in self.validators if not isinstance(v, (ProhibitNullCharactersValidator, ProhibitSurrogateCharactersValidator))
        ]

    def to_internal_value(self, data):
        data = data if isinstance(data, str) else str(data)  # whatever an agent put there: kept as text
        return clean_text(super().to_internal_value(data)[: self.cut_at])


class TrainerLog(serializers.JSONField):
    """A trainer's last lines: a string or a list of lines, stored as one cleaned string of its last ``max_length`` characters."""

    def __init__(self, *, max_length, **kwargs):
        self.cut_at = max_length
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, list):
            data = "\n".join(item if isinstance(item, str) else str(item) for item in data)
        elif not isinstance(data, str):
            data = str(data)
        return super().to_internal_value(clean_text(data[-self.cut_at :]))


class TrainerLogLines(serializers.JSONField):
    """A run of a trainer's output lines, ``{"from": n, "lines": [...]}``: each line cleaned and cut to
    ``line_chars``, at most ``max_lines`` kept. Never refused: a malformed run is ignored (None)."""

    def __init__(self, *, max_lines, line_chars, **kwargs):
        self.max_lines, self.line_chars = max_lines, line_chars
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        start = data.get("from") if isinstance(data, dict) else None
        lines = data.get("lines") if isinstance(data, dict) else None
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < 2**31 or not isinstance(lines, list):
            return None
        kept = [clean_text(line if isinstance(line, str) else str(line))[: self.line_chars] for line in lines[: self.max_lines]]
        return {"from": start, "lines": kept}


class TrainerJSON(serializers.JSONField):
    """JSON a trainer produced (progress): cleaned by ``clean_trainer_json``, never refused for its content."""

    def to_internal_value(self, data):
        return super().to_internal_value(clean_trainer_json(data))


def _kinds(types):
    names = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return " or ".join(dict.fromkeys(names[t] for t in types))
