"""Serializer fields for everything a client sends: each with a declared bound, each refusal a 400 naming the field.

Every input serializer of the API uses these (a test checks it): chosen text and JSON are refused when
they cannot be stored (``common.inputs``), a trainer's text and JSON are cleaned and kept.
"""

from django.core.validators import ProhibitNullCharactersValidator
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from rest_framework import serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from worker_agent import protocol

from .inputs import (
    LABEL_KEY_MAX_CHARS,
    LABEL_KEY_RE,
    LABEL_VALUE_MAX_CHARS,
    LABEL_VALUE_RE,
    NO_NUL_PATTERN,
    clean_text,
    clean_trainer_json,
    json_problem,
    json_size,
    limit,
)


# What a client sends is taken as the JSON type the schema declares, never coerced from another: DRF's own
# fields would take 0 for a name, "5" for a number and "yes" for a boolean, which the OpenAPI schema
# (and so any generated client) says is an error.


class BoundedText(serializers.CharField):
    """A JSON string of at most ``max_length`` characters; a NUL or an unpaired surrogate is refused (DRF's own checks)."""

    default_error_messages = {"invalid": "Must be a string."}

    def __init__(self, *, max_length, schema_pattern=NO_NUL_PATTERN, **kwargs):
        self.schema_pattern = schema_pattern  # what the OpenAPI schema declares (a service may check more)
        super().__init__(max_length=max_length, **kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class BoundedInt(serializers.IntegerField):
    """A JSON integer in ``[min_value, max_value]``: both bounds are required."""

    default_error_messages = {"invalid": "Must be an integer."}

    def __init__(self, *, min_value, max_value, **kwargs):
        super().__init__(min_value=min_value, max_value=max_value, **kwargs)

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, (int, float)) or (isinstance(data, float) and not data.is_integer()):
            self.fail("invalid")
        return super().to_internal_value(data)


class BoundedFloat(serializers.FloatField):
    """A finite JSON number in ``[min_value, max_value]``: both bounds are required."""

    default_error_messages = {"invalid": "Must be a number."}

    def __init__(self, *, min_value, max_value, **kwargs):
        super().__init__(min_value=min_value, max_value=max_value, **kwargs)

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBoolean(serializers.BooleanField):
    """JSON ``true`` or ``false`` (DRF's own also takes 1, "yes", "on"...)."""

    default_error_messages = {"invalid": "Must be true or false."}

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


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

    def openapi_schema(self):
        """Return the OpenAPI schema of what this field accepts: its ``types``, with no NUL in any key or string."""
        kinds = [_JSON_SCHEMAS[kind] for kind in dict.fromkeys(_JSON_KINDS[t] for t in self.types)]
        return kinds[0] if len(kinds) == 1 else {"anyOf": kinds}

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


class Labels(BoundedJSON):
    """A worker's labels or a job's label selectors (name -> value or glob): an object, checked by
    ``common.inputs.clean_labels`` in the service (400 ``invalid_labels``) and declared to the schema by the same rules."""

    def __init__(self, **kwargs):
        super().__init__(types=(dict,), **kwargs)

    def openapi_schema(self):
        value = {"type": "string", "maxLength": LABEL_VALUE_MAX_CHARS, "pattern": LABEL_VALUE_RE.pattern}
        return {
            "type": "object",
            "maxProperties": limit("MAX_LABELS"),
            "propertyNames": {"maxLength": LABEL_KEY_MAX_CHARS, "pattern": LABEL_KEY_RE.pattern},
            "additionalProperties": {"oneOf": [value, {"type": "number"}, {"type": "boolean"}]},
        }


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
    ``line_chars``, at most ``max_lines`` kept. Its keys are the agent's schema: another key is refused (400
    naming it, as an unknown field is); a malformed run is ignored (None), never refused for what the trainer
    wrote."""

    KEYS = (protocol.LOG_LINES_FROM, "lines")

    def __init__(self, *, max_lines, line_chars, **kwargs):
        self.max_lines, self.line_chars = max_lines, line_chars
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        unknown = [key for key in data if key not in self.KEYS] if isinstance(data, dict) else None
        if unknown:
            shown = clean_text(str(unknown[0]))[:100]
            raise serializers.ValidationError(
                f"unknown key {shown!r}: a run of lines takes only {' and '.join(self.KEYS)}", code="unknown_field"
            )
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


# JSON a client chooses, as the OpenAPI schema declares it: any value, but no NUL in a key or a string
# (PostgreSQL cannot store one); the depth and size limits are checked, not declared.
JSON_VALUE_REF = {"$ref": "#/components/schemas/JSONValue"}
_JSON_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_JSON_SCHEMAS = {
    "object": {"type": "object", "propertyNames": {"pattern": NO_NUL_PATTERN}, "additionalProperties": JSON_VALUE_REF},
    "array": {"type": "array", "items": JSON_VALUE_REF},
    "string": {"type": "string", "pattern": NO_NUL_PATTERN},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
}


def add_json_value_schema(result, generator, request, public):
    """Postprocessing hook: the ``JSONValue`` component the BoundedJSON fields refer to (null included)."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["JSONValue"] = {"anyOf": [*_JSON_SCHEMAS.values(), {"type": "null"}]}
    return result


def _kinds(types):
    names = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


# --- what the OpenAPI schema says these fields accept ---------------------------------------------


class BoundedTextSchema(OpenApiSerializerFieldExtension):
    """Declare what DRF's own checks refuse in a BoundedText: a NUL (as a pattern, beside drf-spectacular's maxLength)."""

    target_class = BoundedText
    match_subclasses = True

    def map_serializer_field(self, auto_schema, direction):
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        # drf-spectacular makes the field nullable after this hook returns; the inner call did it already.
        kinds = [kind for kind in schema.get("type", []) if kind != "null"] if isinstance(schema.get("type"), list) else None
        if kinds:
            schema["type"] = kinds[0] if len(kinds) == 1 else kinds
        return {**schema, "pattern": self.target.schema_pattern}


class BoundedJSONSchema(OpenApiSerializerFieldExtension):
    """Tell drf-spectacular what a BoundedJSON accepts, instead of "any value"."""

    target_class = BoundedJSON
    match_subclasses = True

    def map_serializer_field(self, auto_schema, direction):
        return self.target.openapi_schema()


class TrainerLogLinesSchema(OpenApiSerializerFieldExtension):
    """Declare the keys a TrainerLogLines takes (``from``, ``lines``; no other): the values are not declared, since a
    malformed run is ignored, never refused."""

    target_class = TrainerLogLines
    match_subclasses = True

    def map_serializer_field(self, auto_schema, direction):
        run = {
            "type": "object",
            "properties": {
                protocol.LOG_LINES_FROM: {"description": "The number of the run's first line (0: the attempt's first)."},
                "lines": {"description": "The lines, in order (strings)."},
            },
            "additionalProperties": False,
        }
        return {"description": self.target.help_text or "", "anyOf": [run, {"not": {"type": "object"}}]}
