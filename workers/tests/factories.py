"""factory_boy factories for users, workers and tokens, plus helpers that issue real tokens."""

import importlib
import uuid
from types import SimpleNamespace

import factory
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.db import connection
from django.utils import timezone
from factory.django import DjangoModelFactory

from workers.models import TokenKind, Worker, WorkerStatus, WorkerType
from workers.services import token_issue


# The data migration that ships the operator groups (viewer, operator, admin).
OPERATOR_GROUPS = importlib.import_module("simpletuner_site.migrations.0001_operator_groups")


def shipped_group(name):
    """Return the shipped permission group ``name`` (viewer, operator, admin), as its data migration makes it.

    A transactional test empties the tables, groups included; the migration is idempotent, so it runs
    again here whenever a group is missing.
    """
    group = Group.objects.filter(name=name).first()
    if group is None:

        OPERATOR_GROUPS.create_operator_groups(apps, SimpleNamespace(connection=connection))
        group = Group.objects.get(name=name)
    return group


class UserFactory(DjangoModelFactory):
    """A user; ``permissions=["queue.submit_job", ...]`` grants model permissions, ``groups=["operator"]``
    puts it in shipped permission groups."""

    class Meta:
        model = get_user_model()
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"operator{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")
    is_active = True

    @factory.post_generation
    def permissions(user, create, extracted, **kwargs):
        for dotted in extracted or ():
            app_label, codename = dotted.split(".", 1)
            user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))

    @factory.post_generation
    def groups(user, create, extracted, **kwargs):
        for name in extracted or ():
            user.groups.add(shipped_group(name))


class WorkerFactory(DjangoModelFactory):
    """An idle persistent worker with an open stream, as after register + GET /api/workers/stream."""

    class Meta:
        model = Worker

    name = factory.Sequence(lambda n: f"gpu-worker-{n}")
    worker_type = WorkerType.PERSISTENT
    status = WorkerStatus.IDLE
    labels = factory.LazyFunction(dict)
    gpu_count = 1
    gpu_name = "NVIDIA A100-SXM4-80GB"
    gpu_vram_gb = 80.0
    accelerator_type = "cuda"
    stream_id = factory.LazyFunction(lambda: uuid.uuid4().hex)
    stream_opened_at = factory.LazyFunction(timezone.now)
    connected_at = factory.LazyFunction(timezone.now)
    last_heartbeat = factory.LazyFunction(timezone.now)

    class Params:
        # Created by an operator, agent never seen.
        fresh = factory.Trait(
            status=WorkerStatus.CONNECTING,
            stream_id=None,
            stream_opened_at=None,
            connected_at=None,
            last_heartbeat=None,
            gpu_count=0,
            gpu_name="",
            gpu_vram_gb=None,
            accelerator_type="",
        )
        offline = factory.Trait(status=WorkerStatus.OFFLINE, stream_id=None)
        draining = factory.Trait(status=WorkerStatus.DRAINING, drain_requested_at=factory.LazyFunction(timezone.now))


def worker_token(worker):
    """Issue a real worker token for ``worker`` and return its plaintext."""
    return token_issue(kind=TokenKind.WORKER, worker=worker)[1]


def api_token(user):
    """Issue a real operator API token for ``user`` and return its plaintext."""
    return token_issue(kind=TokenKind.API, user=user)[1]
