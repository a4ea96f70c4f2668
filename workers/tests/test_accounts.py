"""Account changes audited in the transaction of the change, whichever way they are made: the admin, Django's
shell commands, the project's own commands, plain model calls."""

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from django.db import transaction

from audit import actions
from audit.models import AuditEvent
from workers import accounts
from workers.tests.factories import UserFactory
from workers.tests.support import admin_url, audit_rows

pytestmark = pytest.mark.django_db

ACCOUNT_ACTIONS = {value for name, value in vars(actions).items() if name.startswith(("USER_", "GROUP_"))}


@pytest.fixture(autouse=True)
def fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def account_rows(**filters):
    """``(action, target_type, target username or group name, details without that name)`` of the account rows."""
    rows = []
    for row in audit_rows(accounts=True, **filters):
        if row.action in ACCOUNT_ACTIONS:
            details = dict(row.details)
            name = details.pop("username", None) or details.pop("group", None)
            rows.append((row.action, row.target_type, name, details))
    return rows


def user_form(user, **changes):
    """The admin's user change form as the page posts it, with ``changes``."""
    data = {
        "username": user.username, "first_name": "", "last_name": "", "email": user.email,
        "is_active": "on" if user.is_active else "", "is_staff": "on" if user.is_staff else "",
        "is_superuser": "on" if user.is_superuser else "",
        "groups": [g.pk for g in user.groups.all()], "user_permissions": [p.pk for p in user.user_permissions.all()],
        "date_joined_0": "2024-01-01", "date_joined_1": "00:00:00", "last_login_0": "", "last_login_1": "",
    }  # fmt: skip
    data.update(changes)
    return {key: value for key, value in data.items() if value != ""}


# --- through the admin --------------------------------------------------------------------------------


def test_a_superuser_flag_and_a_group_set_in_the_admin_are_audited_as_the_admin(admin_client, admin_user):
    viewer = UserFactory(username="viewer", groups=["viewer"])
    operator = Group.objects.get(name="operator")
    before = AuditEvent.objects.count()

    response = admin_client.post(
        admin_url(viewer), user_form(viewer, is_staff="on", is_superuser="on", groups=[operator.pk]), REMOTE_ADDR="192.0.2.4"
    )

    assert response.status_code == 302, response.context["adminform"].form.errors
    rows = AuditEvent.objects.order_by("id")[before:]
    assert [(r.action, r.details) for r in rows] == [
        (actions.USER_STAFF_CHANGED, {"username": "viewer", "is_staff": True}),
        (actions.USER_SUPERUSER_CHANGED, {"username": "viewer", "is_superuser": True}),
        (actions.USER_GROUPS_CHANGED, {"username": "viewer", "removed": ["viewer"]}),
        (actions.USER_GROUPS_CHANGED, {"username": "viewer", "added": ["operator"]}),
    ]
    assert {(r.actor_type, r.actor_id, r.actor_name, r.client_ip) for r in rows} == {
        ("user", str(admin_user.pk), "admin", "192.0.2.4")
    }
    assert {(r.target_type, r.target_id) for r in rows} == {("user", str(viewer.pk))}


def test_a_password_set_in_the_admin_is_audited_without_its_hash(admin_client):
    viewer = UserFactory(username="viewer")

    response = admin_client.post(
        admin_url(viewer, "password_change"), {"password1": "a-long-new-secret", "password2": "a-long-new-secret"}
    )

    assert response.status_code == 302
    viewer.refresh_from_db()
    assert account_rows(target_id=viewer.pk)[-1] == (actions.USER_PASSWORD_CHANGED, "user", "viewer", {"usable_password": True})
    hash_text = viewer.password.split("$")[-1]
    assert not AuditEvent.objects.filter(details__icontains=hash_text).exists()
    assert not AuditEvent.objects.filter(details__icontains="a-long-new-secret").exists()


def test_a_user_deleted_in_the_admin_is_audited(admin_client):
    viewer = UserFactory(username="viewer")

    assert admin_client.post(admin_url(viewer, "delete"), {"post": "yes"}).status_code == 302

    assert account_rows()[-1] == (actions.USER_DELETED, "user", "viewer", {})
    assert audit_rows(action=actions.USER_DELETED)[0].target_id == str(viewer.pk)


# --- shell commands -----------------------------------------------------------------------------------


def test_createsuperuser_and_changepassword_are_audited_as_the_system(monkeypatch):
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a-long-first-secret")
    call_command("createsuperuser", "--noinput", "--username", "root", "--email", "root@example.com")
    typed = "a-long-new-secret"
    monkeypatch.setattr("django.contrib.auth.management.commands.changepassword.getpass.getpass", lambda prompt: typed)
    call_command("changepassword", "root")

    assert account_rows() == [
        (actions.USER_CREATED, "user", "root",
         {"is_active": True, "is_staff": True, "is_superuser": True, "usable_password": True}),
        (actions.USER_PASSWORD_CHANGED, "user", "root", {"usable_password": True}),
    ]  # fmt: skip
    assert {(r.actor_type, r.actor_name) for r in audit_rows(accounts=True)} == {("system", "system")}


def test_a_superuser_made_by_create_api_token_is_audited_as_that_command(capsys):
    call_command("create_api_token", "ops", "--superuser")

    (created,) = audit_rows(action=actions.USER_CREATED)
    assert (created.actor_type, created.actor_name) == ("system", "manage.py create_api_token")
    assert created.details == {
        "username": "ops", "is_active": True, "is_staff": True, "is_superuser": True, "usable_password": False,
    }  # fmt: skip


# --- every kind of change, by plain model calls -------------------------------------------------------


def test_flags_names_and_deletion_of_a_user(django_capture_on_commit_callbacks):
    user = UserFactory(username="alice")

    user.is_active = False
    user.save()
    user.is_active, user.is_staff, user.username = True, True, "alice2"
    user.save()
    user.is_staff = False
    user.save(update_fields=["is_staff"])
    user.email = "new@example.com"
    user.save()  # nothing audited changed
    user.delete()

    assert account_rows() == [
        (actions.USER_CREATED, "user", "alice",
         {"is_active": True, "is_staff": False, "is_superuser": False, "usable_password": True}),
        (actions.USER_DEACTIVATED, "user", "alice", {}),
        (actions.USER_RENAMED, "user", "alice2", {"renamed_from": "alice"}),
        (actions.USER_ACTIVATED, "user", "alice2", {}),
        (actions.USER_STAFF_CHANGED, "user", "alice2", {"is_staff": True}),
        (actions.USER_STAFF_CHANGED, "user", "alice2", {"is_staff": False}),
        (actions.USER_DELETED, "user", "alice2", {}),
    ]  # fmt: skip


def test_group_memberships_from_either_side_and_cleared(django_capture_on_commit_callbacks):
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    viewer, operator = Group.objects.get(name="viewer"), Group.objects.get(name="operator")
    before = AuditEvent.objects.count()

    alice.groups.add(viewer, operator)
    alice.groups.add(viewer)  # already a member: nothing
    viewer.user_set.add(bob)
    alice.groups.remove(operator, Group.objects.get(name="admin"))  # not in admin: only operator removed
    viewer.user_set.clear()

    rows = [(r.action, r.details) for r in AuditEvent.objects.order_by("id")[before:]]
    assert rows == [
        (actions.USER_GROUPS_CHANGED, {"username": "alice", "added": ["operator", "viewer"]}),
        (actions.USER_GROUPS_CHANGED, {"username": "bob", "added": ["viewer"]}),
        (actions.USER_GROUPS_CHANGED, {"username": "alice", "removed": ["operator"]}),
        (actions.USER_GROUPS_CHANGED, {"username": "alice", "removed": ["viewer"]}),
        (actions.USER_GROUPS_CHANGED, {"username": "bob", "removed": ["viewer"]}),
    ]


def test_permissions_of_users_and_groups_and_groups_themselves():
    alice = UserFactory(username="alice")
    view_worker = Permission.objects.get(content_type__app_label="workers", codename="view_worker")
    view_job = Permission.objects.get(content_type__app_label="queue", codename="view_job")
    before = AuditEvent.objects.count()

    alice.user_permissions.add(view_worker, view_job)
    alice.user_permissions.clear()
    group = Group.objects.create(name="night-shift")
    group.permissions.set([view_job])
    view_job.group_set.remove(group)
    group.name = "day-shift"
    group.save()
    alice.groups.add(group)
    group.delete()

    rows = [(r.action, r.target_type, r.details) for r in AuditEvent.objects.order_by("id")[before:]]
    assert rows == [
        (actions.USER_PERMISSIONS_CHANGED, "user", {"username": "alice", "added": ["queue.view_job", "workers.view_worker"]}),
        (actions.USER_PERMISSIONS_CHANGED, "user", {"username": "alice", "removed": ["queue.view_job", "workers.view_worker"]}),
        (actions.GROUP_CREATED, "group", {"group": "night-shift"}),
        (actions.GROUP_PERMISSIONS_CHANGED, "group", {"group": "night-shift", "added": ["queue.view_job"]}),
        (actions.GROUP_PERMISSIONS_CHANGED, "group", {"group": "night-shift", "removed": ["queue.view_job"]}),
        (actions.GROUP_RENAMED, "group", {"group": "day-shift", "renamed_from": "night-shift"}),
        (actions.USER_GROUPS_CHANGED, "user", {"username": "alice", "added": ["day-shift"]}),
        (actions.GROUP_DELETED, "group", {"group": "day-shift", "members": 1}),
    ]


def test_a_hash_upgraded_at_sign_in_is_no_password_change(settings, client):
    user = UserFactory(username="alice", is_staff=True)
    user.set_password("a-long-secret")
    user.save()
    settings.PASSWORD_HASHERS = [
        "django.contrib.auth.hashers.ScryptPasswordHasher", "django.contrib.auth.hashers.MD5PasswordHasher",
    ]  # fmt: skip

    assert client.login(username="alice", password="a-long-secret")

    user.refresh_from_db()
    assert user.password.startswith("scrypt$")  # upgraded
    assert [row[0] for row in account_rows()] == [actions.USER_CREATED, actions.USER_PASSWORD_CHANGED]


def test_access_changes_are_announced_on_commit_and_a_rename_is_not(django_capture_on_commit_callbacks, monkeypatch):
    announced = []
    monkeypatch.setattr(accounts.outbox, "emit_on_commit", lambda topic, **payload: announced.append((topic, payload)))
    alice = UserFactory(username="alice", groups=["viewer"])
    announced.clear()

    alice.groups.clear()
    alice.username = "alice2"
    alice.save()  # a rename changes no access
    alice.is_active = False
    alice.save()

    assert announced == [(accounts.ACCESS_CHANGED, {"user_ids": [alice.pk]})] * 2


# --- one transaction with the change --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_save_outside_a_transaction_commits_with_its_audit_row_or_not_at_all(monkeypatch):
    user = UserFactory(username="alice")

    def broken(**kwargs):
        raise RuntimeError("the audit row could not be written")

    user.is_superuser = True
    with monkeypatch.context() as patched, pytest.raises(RuntimeError):
        patched.setattr(accounts, "audit_record", broken)
        user.save()  # no transaction around it: its UPDATE would have committed on its own

    assert not get_user_model().objects.get(pk=user.pk).is_superuser
    user.save()
    assert get_user_model().objects.get(pk=user.pk).is_superuser
    assert account_rows()[-1] == (actions.USER_SUPERUSER_CHANGED, "user", "alice", {"is_superuser": True})


@pytest.mark.django_db(transaction=True)
def test_a_change_rolled_back_leaves_no_audit_row():
    user = UserFactory(username="alice")

    with pytest.raises(RuntimeError), transaction.atomic():
        user.is_superuser = True
        user.save()
        raise RuntimeError("something after the change failed")

    assert [row[0] for row in account_rows()] == [actions.USER_CREATED]
