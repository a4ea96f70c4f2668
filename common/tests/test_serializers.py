"""common.serializers.ModelSerializer: the model's fields built once per class, each instance its own copy."""

from unittest import mock

import pytest
from rest_framework import serializers

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
