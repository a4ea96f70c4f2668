"""Models and migrations agree (`makemigrations --check` is a test), and the data migrations hand out permissions right."""

import importlib
from io import StringIO
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection

from workers.models import Worker
from workers.tests.factories import UserFactory


@pytest.mark.django_db
def test_no_missing_migrations():
    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=StringIO())
    except SystemExit as exit_:  # --check exits non-zero when a migration would be written
        pytest.fail(f"models and migrations disagree (exit {exit_.code}); run makemigrations:\n{out.getvalue()}")
    assert "No changes detected" in out.getvalue()


# --- the permission data migrations -----------------------------------------------------------------

GROUPS_MIGRATION = importlib.import_module("simpletuner_site.migrations.0001_operator_groups")
SPLIT_MIGRATION = importlib.import_module("workers.migrations.0003_worker_permissions")
ARTIFACTS_MIGRATION = importlib.import_module("artifacts.migrations.0002_artifact_permissions")
CONFIGS_MIGRATION = importlib.import_module("training_configs.migrations.0002_config_permissions")
SECRETS_MIGRATION = importlib.import_module("training_configs.migrations.0003_view_config_secrets")
TENANCY_MIGRATION = importlib.import_module("tenancy.migrations.0002_tenancy_permissions")
PRIORITY_MIGRATION = importlib.import_module("tenancy.migrations.0003_prioritize_jobs")
WEBHOOKS_MIGRATION = importlib.import_module("webhooks.migrations.0002_webhook_permissions")
EDITOR = SimpleNamespace(connection=connection)


def _group_permissions():
    return {
        group.name: sorted(f"{p.content_type.app_label}.{p.codename}" for p in group.permissions.all())
        for group in Group.objects.prefetch_related("permissions__content_type")
    }


@pytest.mark.django_db
def test_the_operator_groups_are_shipped_with_their_permissions():
    GROUPS_MIGRATION.create_operator_groups(apps, EDITOR)  # a transactional test may have emptied the tables
    ARTIFACTS_MIGRATION.grant(apps, EDITOR)
    CONFIGS_MIGRATION.grant(apps, EDITOR)
    SECRETS_MIGRATION.grant(apps, EDITOR)
    WEBHOOKS_MIGRATION.grant(apps, EDITOR)
    TENANCY_MIGRATION.grant(apps, EDITOR)
    PRIORITY_MIGRATION.grant(apps, EDITOR)

    groups = _group_permissions()

    assert set(groups) >= {"viewer", "operator", "admin"}
    for name, shipped in (("viewer", GROUPS_MIGRATION.VIEWER), ("operator", GROUPS_MIGRATION.OPERATOR), ("admin", GROUPS_MIGRATION.ADMIN)):
        granted = {*ARTIFACTS_MIGRATION.GRANTS[name], *CONFIGS_MIGRATION.GRANTS[name], *SECRETS_MIGRATION.GRANTS.get(name, ())}
        granted |= set(TENANCY_MIGRATION.GRANTS[name]) | set(PRIORITY_MIGRATION.GRANTS.get(name, ()))
        granted |= set(WEBHOOKS_MIGRATION.GRANTS.get(name, ()))
        assert groups[name] == sorted({*shipped, *granted}), name
    assert "artifacts.download_artifact" not in groups["viewer"]
    assert [name for name in ("viewer", "operator", "admin") if "configs.view_config_secrets" in groups[name]] == ["admin"]
    assert "artifacts.download_artifact" in groups["operator"]
    assert [name for name in ("viewer", "operator", "admin") if "webhooks.view_webhook" in groups[name]] == ["admin"]
    assert [name for name in ("viewer", "operator", "admin") if "tenancy.set_limits" in groups[name]] == ["admin"]
    assert set(GROUPS_MIGRATION.VIEWER) < set(GROUPS_MIGRATION.OPERATOR) < set(GROUPS_MIGRATION.ADMIN)
    assert all(p.startswith(("workers.view_", "queue.view_", "audit.view_")) for p in GROUPS_MIGRATION.VIEWER)


@pytest.mark.django_db
def test_the_operator_groups_migration_is_idempotent_and_keeps_additions():
    GROUPS_MIGRATION.create_operator_groups(apps, EDITOR)
    extra = Permission.objects.get(content_type__app_label="auth", codename="view_user")
    Group.objects.get(name="viewer").permissions.add(extra)
    before = _group_permissions()

    GROUPS_MIGRATION.create_operator_groups(apps, EDITOR)

    assert _group_permissions() == before
    assert Group.objects.filter(name__in=["viewer", "operator", "admin"]).count() == 3


@pytest.mark.django_db
def test_holders_of_the_old_manage_workers_permission_keep_every_action_it_allowed():
    old = Permission.objects.create(
        codename="manage_workers", name="Can manage workers", content_type=ContentType.objects.get_for_model(Worker)
    )
    user, other = UserFactory(), UserFactory()
    user.user_permissions.add(old)
    group = Group.objects.create(name="fleet managers")
    group.permissions.add(old)

    SPLIT_MIGRATION.split_manage_workers(apps, EDITOR)

    assert not Permission.objects.filter(codename="manage_workers").exists()
    fresh = type(user).objects.get(pk=user.pk)  # no cached permissions
    assert {p for p in SPLIT_MIGRATION.MANAGE_WORKERS_BECAME if fresh.has_perm(p)} == set(SPLIT_MIGRATION.MANAGE_WORKERS_BECAME)
    assert sorted(f"{p.content_type.app_label}.{p.codename}" for p in group.permissions.all()) == sorted(
        SPLIT_MIGRATION.MANAGE_WORKERS_BECAME
    )
    assert not type(other).objects.get(pk=other.pk).get_all_permissions()
