"""DRF's serializers for the API: a field a serializer does not declare is refused, each instance's fields are
copied cheaply, and a model serializer's are built once per class."""

import copy
import difflib
from collections.abc import Mapping

from drf_spectacular.extensions import OpenApiSerializerExtension
from rest_framework import serializers
from rest_framework.relations import ManyRelatedField
from rest_framework.settings import api_settings

from .inputs import clean_text

UNKNOWN_FIELD = "unknown_field"  # the code of each refusal (``ErrorDetail.code``)
UNKNOWN_NAMED_MAX = 10  # unknown fields named one by one in the errors; the rest are counted
_NAME_SHOWN_MAX_CHARS = 100


def own_fields(fields):
    """Return an instance's own copies of a class's unbound ``fields`` (``{name: field}``).

    DRF deep-copies them for each instance, and a field's ``__deepcopy__`` calls its constructor again
    with copies of its arguments (0.2 ms for the job's 29 fields, on every response). A plain field needs
    less: binding it sets attributes of its own (``field_name``, ``parent``, ``source``, ``source_attrs``,
    ``label``), which a shallow copy keeps apart from the class's; the rest (arguments, validators,
    choices) is never changed after construction. A field holding fields (a nested serializer, a list
    or dict field, a many-related field) is deep-copied as DRF does: its children point back at it.
    """
    return {name: copy.deepcopy(field) if _holds_fields(field) else copy.copy(field) for name, field in fields.items()}


def _holds_fields(field):
    return isinstance(field, (serializers.BaseSerializer, ManyRelatedField)) or hasattr(field, "child")


def unknown_field_errors(names, known):
    """Return the validation errors that refuse the fields ``names`` (an input's keys that no field of ``known``
    takes): ``{name: [message]}`` for the first UNKNOWN_NAMED_MAX (a close known name suggested), the rest counted
    under ``non_field_errors``. A name is shown cleaned and cut, so any key can be named in a JSON answer."""
    known = list(known)
    takes = ", ".join(known) if known else "no fields"
    errors = {}
    for name in names[:UNKNOWN_NAMED_MAX]:
        guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if len(name) <= _NAME_SHOWN_MAX_CHARS else None
        hint = f" Did you mean {guess[0]}?" if guess else ""
        message = f"Unknown field: this endpoint takes {takes}.{hint}"
        errors[clean_text(str(name))[:_NAME_SHOWN_MAX_CHARS]] = [serializers.ErrorDetail(message, code=UNKNOWN_FIELD)]
    if len(names) > UNKNOWN_NAMED_MAX:
        more = f"{len(names) - UNKNOWN_NAMED_MAX} more unknown fields"
        errors[api_settings.NON_FIELD_ERRORS_KEY] = [serializers.ErrorDetail(more, code=UNKNOWN_FIELD)]
    return errors


class RefuseUnknownFields:
    """Refuse an input that holds a field the serializer does not take (declared and writable): 400 with each
    unknown field named in ``errors`` (``unknown_field_errors``), beside the other fields' errors.

    DRF drops such a field without a word, so a slip (``labels`` for a job's ``worker_labels``) was taken as
    leaving the field out. The check is a set look-up per key: the heartbeat's lean path runs it too.
    """

    def to_internal_value(self, data):
        if not isinstance(data, Mapping):
            return super().to_internal_value(data)  # DRF's own refusal of a body that is not an object
        fields = self.fields
        unknown = [name for name in data if name not in fields or fields[name].read_only]
        if not unknown:
            return super().to_internal_value(data)
        errors = unknown_field_errors(unknown, (name for name, field in fields.items() if not field.read_only))
        try:
            super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if isinstance(exc.detail, Mapping):
                errors = {**exc.detail, **errors}
        raise serializers.ValidationError(errors)


class Serializer(RefuseUnknownFields, serializers.Serializer):
    """DRF's ``Serializer``: an unknown field refused (``RefuseUnknownFields``), each instance's declared fields
    copied by ``own_fields``."""

    def get_fields(self):
        return own_fields(self._declared_fields)


class NoFieldsSerializer(Serializer):
    """The body of an endpoint that takes no fields: none, ``{}`` or ``null``; every field is unknown."""


def refuse_fields(data):
    """Raise ValidationError (400) naming each field of ``data``, the body of an endpoint that takes none."""
    if data is None or (isinstance(data, Mapping) and not data):
        return
    NoFieldsSerializer(data=data).is_valid(raise_exception=True)


class RefuseUnknownFieldsSchema(OpenApiSerializerExtension):
    """Declare to the OpenAPI schema what ``RefuseUnknownFields`` refuses: a request body takes no other properties."""

    target_class = RefuseUnknownFields
    match_subclasses = True

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        if direction == "request" and schema.get("type") == "object":
            schema["additionalProperties"] = False
        return schema


class ModelSerializer(RefuseUnknownFields, serializers.ModelSerializer):
    """DRF's ``ModelSerializer`` (an unknown field refused), except that the fields it builds from the model are
    built once per class.

    ``ModelSerializer.get_fields`` introspects the model on every instantiation (``build_field`` for each
    of ``Meta.fields``): on a submit, 10% of the request's CPU went to describing the job's columns again.
    What it builds depends only on the class (its ``Meta`` and declared fields), never on the instance,
    data or context, so the first instance's unbound fields are kept and each instance gets its own
    copies of them (``own_fields``).
    """

    def get_fields(self):
        cls = type(self)
        built = cls.__dict__.get("_built_fields")
        if built is None:
            built = super().get_fields()
            cls._built_fields = built  # this class's own: a subclass has other fields
        return own_fields(built)
