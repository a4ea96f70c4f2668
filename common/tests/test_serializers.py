"""common.serializers: a model serializer's fields built once per class; each instance its own copies of its fields."""

from unittest import mock

import pytest
from rest_framework import serializers

from common.serializers import Serializer
from job_queue.api.serializers import JobSerializer
from job_queue.tests.factories import JobFactory

pytestmark = pytest.mark.django_db


def test_fields_are_built_from_the_model_once_per_class_and_serialize_as_the_first_built():
    class Probe(JobSerializer):  # a class of its own: nothing built yet, though JobSerializer may have been
        class Meta(JobSerializer.Meta):
            pass

    jobs = [JobFactory(config_name=f"c{i}", worker_labels={"gpu": str(i)}) for i in range(3)]
    real = serializers.ModelSerializer.get_fields
    with mock.patch.object(serializers.ModelSerializer, "get_fields", autospec=True, side_effect=real) as built:
        data = [dict(Probe(job).data) for job in jobs]
        first_built = dict(Probe(jobs[0]).data)
    assert built.call_count == 1
    assert data[0] == first_built and data[1]["config_name"] == "c1" and data[2]["worker_labels"] == {"gpu": "2"}
    assert data == [dict(JobSerializer(job).data) for job in jobs]


def test_each_instance_gets_its_own_fields():
    first, second = JobSerializer(), JobSerializer()
    first.fields["config_name"].label = "changed"
    assert first.fields["config_name"] is not second.fields["config_name"]
    assert second.fields["config_name"].label != "changed"
    assert first.fields["config_name"].parent is first and second.fields["config_name"].parent is second


class _Probe(Serializer):
    name = serializers.CharField(max_length=10)
    tags = serializers.ListField(child=serializers.CharField(max_length=5), required=False)


class _Outer(Serializer):
    inner = _Probe()


def test_a_plain_serializer_instance_binds_its_own_fields_and_leaves_the_class_unbound():
    first, second = _Probe(data={"name": "a", "tags": ["x"]}), _Probe(data={"name": "bb"})
    assert first.is_valid() and second.is_valid()
    assert first.fields["name"] is not second.fields["name"]
    assert first.fields["name"].parent is first and second.fields["name"].parent is second
    assert first.validated_data == {"name": "a", "tags": ["x"]} and second.validated_data == {"name": "bb"}
    declared = _Probe._declared_fields["name"]
    assert declared.parent is None and declared.field_name is None and declared.source is None


def test_a_field_holding_fields_is_copied_deep():
    first, second = _Probe(), _Probe()
    assert first.fields["tags"].child is not second.fields["tags"].child
    assert first.fields["tags"].child.parent is first.fields["tags"]
    outer_a, outer_b = _Outer(), _Outer()
    assert outer_a.fields["inner"] is not outer_b.fields["inner"]
    assert outer_a.fields["inner"].fields["name"].parent is outer_a.fields["inner"]


def test_invalid_input_is_refused_per_instance():
    bad, good = _Probe(data={"name": "x" * 11}), _Probe(data={"name": "ok"})
    assert not bad.is_valid() and "name" in bad.errors
    assert good.is_valid() and good.errors == {}
