"""DRF's serializers with each instance's fields copied cheaply, and a model serializer's built once per class."""

import copy

from rest_framework import serializers
from rest_framework.relations import ManyRelatedField


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


class Serializer(serializers.Serializer):
    """DRF's ``Serializer``, each instance's declared fields copied by ``own_fields``."""

    def get_fields(self):
        return own_fields(self._declared_fields)


class ModelSerializer(serializers.ModelSerializer):
    """DRF's ``ModelSerializer``, except that the fields it builds from the model are built once per class.

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
