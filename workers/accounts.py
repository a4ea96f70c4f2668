"""Account changes audited: users, groups, their permissions and sign-ins, whichever way they are made.

Django has no one service for accounts: the admin, ``createsuperuser``, ``changepassword`` and our own
commands each save users their own way. So the model signals hand every change to these services
(``workers.receivers``), and each writes its audit rows in the transaction of the change; a user's or a
group's ``save()`` made outside a transaction gets one of its own (``atomic_saves``), so the change and
its rows commit together or not at all. A change that may take access away (deactivation, a lost flag,
group or permission, a new password, a deleted user, group or session) also announces the users
concerned once it commits (``ACCESS_CHANGED``): their open operator feeds are re-checked at once
(``realtime.operator_feed``). A password or its hash is never recorded.

A change made by an admin page names its signed-in user (``acting_as``); one made outside a request
(a shell, a command) names the system. A queryset ``update()`` bypasses the signals, as it bypasses
every model signal: it is neither audited nor announced (the operator feed's periodic re-check still
closes a feed it made unfollowable).
"""

import functools
from contextvars import ContextVar

from django.contrib.auth import SESSION_KEY, get_user_model
from django.contrib.auth.models import Group, Permission
from django.db import connection

from audit import actions
from audit.models import ActorType
from audit.services import Actor, audit_record, audited_atomic
from common import outbox
from common.remote import client_ip
from common.scoped import bound

# Emitted once a transaction that may have taken access away commits; payload: user_ids (a list).
ACCESS_CHANGED = "account.access_changed"

_acting = ContextVar("account_actor", default=None)
# The instance attributes holding what a save or delete, and a removal from a relation, are about to change.
_BEFORE = "_account_audit_before"
_RELATIONS_BEFORE = "_account_audit_relations_before"


def acting_as(actor):
    """Name ``actor`` in the audit rows of the account changes made inside the block."""
    return bound(_acting, actor)


def _actor():
    return _acting.get() or Actor.system()


def atomic_saves(*models):
    """Make each model's ``save()`` made outside a transaction run in one (``audited_atomic``), so that the audit
    rows its signals write commit with it or not at all; inside a transaction it is left as it is. Idempotent."""
    for model in models:
        if not getattr(model.save, "audited_atomic", False):
            model.save = _atomic_save(model.save)


def _atomic_save(save):
    @functools.wraps(save)
    def atomic_save(self, *args, **kwargs):
        if connection.in_atomic_block:
            return save(self, *args, **kwargs)
        with audited_atomic():
            return save(self, *args, **kwargs)

    atomic_save.audited_atomic = True
    return atomic_save


# --- users and groups saved or deleted ---------------------------------------------------------------

_TRACKED = {"user": ("username", "is_active", "is_staff", "is_superuser", "password"), "group": ("name",)}


def _kind(instance):
    return "user" if isinstance(instance, get_user_model()) else "group"


def _label(instance):
    return {"username": instance.get_username()} if _kind(instance) == "user" else {"group": instance.name}


def _record(action, instance, details=None):
    audit_record(
        actor=_actor(),
        action=action,
        target_type=_kind(instance),
        target_id=instance.pk,
        details={**_label(instance), **(details or {})},
    )


def _announce_access_changed(user_ids):
    user_ids = sorted(set(user_ids))
    if user_ids:
        outbox.emit_on_commit(ACCESS_CHANGED, user_ids=user_ids)


def account_before_save(instance, update_fields):
    """Remember the stored values of ``instance``'s (a user's or group's) audited fields that this save may change.

    Not the password when the save is Django's own upgrade of its hash at sign-in (``update_fields`` only
    the password, no new password set): that is no password change.
    """
    fields = _TRACKED[_kind(instance)]
    if update_fields is not None:
        fields = [name for name in fields if name in update_fields]
        if set(update_fields) == {"password"} and getattr(instance, "_password", None) is None:
            fields = []
    before = None
    if fields and not instance._state.adding and instance.pk is not None:
        before = type(instance)._base_manager.filter(pk=instance.pk).values(*fields).first()
    setattr(instance, _BEFORE, before)


def account_saved(instance, *, created):
    """Audit a user or group just saved: its creation, or each audited field that changed (``account_before_save``)."""
    before = getattr(instance, _BEFORE, None)
    setattr(instance, _BEFORE, None)
    kind = _kind(instance)
    if created:
        if kind == "user":
            flags = {name: getattr(instance, name) for name in ("is_active", "is_staff", "is_superuser")}
            _record(actions.USER_CREATED, instance, {**flags, "usable_password": instance.has_usable_password()})
        else:
            _record(actions.GROUP_CREATED, instance)
        return
    changed = [(name, old, getattr(instance, name)) for name, old in (before or {}).items() if getattr(instance, name) != old]
    for name, old, new in changed:
        if name == "password":
            _record(actions.USER_PASSWORD_CHANGED, instance, {"usable_password": instance.has_usable_password()})
        elif name == "is_active":
            _record(actions.USER_ACTIVATED if new else actions.USER_DEACTIVATED, instance)
        elif name == "is_staff":
            _record(actions.USER_STAFF_CHANGED, instance, {"is_staff": new})
        elif name == "is_superuser":
            _record(actions.USER_SUPERUSER_CHANGED, instance, {"is_superuser": new})
        else:  # a user's username or a group's name
            _record(actions.USER_RENAMED if kind == "user" else actions.GROUP_RENAMED, instance, {"renamed_from": old})
    if kind == "user" and any(name != "username" for name, _old, _new in changed):
        _announce_access_changed([instance.pk])


def account_before_delete(instance):
    """Remember who belongs to a group about to be deleted (their membership goes with it)."""
    if _kind(instance) == "group":
        setattr(instance, _BEFORE, list(instance.user_set.values_list("pk", flat=True)))


def account_deleted(instance):
    """Audit a user or group just deleted (in the deletion's transaction) and announce whose access it changed."""
    if _kind(instance) == "user":
        _record(actions.USER_DELETED, instance)
        _announce_access_changed([instance.pk])
    else:
        members = getattr(instance, _BEFORE, None) or []
        _record(actions.GROUP_DELETED, instance, {"members": len(members)})
        _announce_access_changed(members)


# --- group memberships and permissions ----------------------------------------------------------------


def _relations():
    """Return ``{through model: (owner model, item model, the owners' m2m field, action)}`` for the audited relations."""
    User = get_user_model()
    return {
        User.groups.through: (User, Group, User._meta.get_field("groups"), actions.USER_GROUPS_CHANGED),
        User.user_permissions.through: (
            User, Permission, User._meta.get_field("user_permissions"), actions.USER_PERMISSIONS_CHANGED,
        ),
        Group.permissions.through: (Group, Permission, Group._meta.get_field("permissions"), actions.GROUP_PERMISSIONS_CHANGED),
    }  # fmt: skip


def relation_through_models():
    """Return the through models of the relations ``relation_changed`` audits."""
    return list(_relations())


def relation_changed(*, through, instance, action, reverse, pk_set):
    """Audit a change to a user's groups or permissions or a group's permissions (an ``m2m_changed``, from either
    side), in its transaction: one row per user or group whose set changed, naming what it gained or lost.

    Before a removal or a clear, the pairs that exist are read, so a row names only what was really removed.
    """
    owner_model, item_model, field, action_name = _relations()[through]
    owner_column, item_column = field.m2m_field_name(), field.m2m_reverse_field_name()
    mine, theirs = (item_column, owner_column) if reverse else (owner_column, item_column)
    if action in ("pre_remove", "pre_clear"):
        existing = through._base_manager.filter(**{mine: instance.pk})
        if pk_set is not None:
            existing = existing.filter(**{f"{theirs}__in": pk_set})
        pairs = list(existing.values_list(f"{owner_column}_id", f"{item_column}_id"))
        setattr(instance, _RELATIONS_BEFORE, {**(getattr(instance, _RELATIONS_BEFORE, None) or {}), through: pairs})
        return
    if action == "post_add":
        pairs = [(pk, instance.pk) if reverse else (instance.pk, pk) for pk in pk_set or ()]
        change = "added"
    elif action in ("post_remove", "post_clear"):
        pairs = (getattr(instance, _RELATIONS_BEFORE, None) or {}).pop(through, [])
        change = "removed"
    else:
        return
    if not pairs:
        return
    owners = owner_model._base_manager.in_bulk({owner for owner, _item in pairs})
    if item_model is Permission:
        items = Permission._base_manager.select_related("content_type").in_bulk({item for _owner, item in pairs})
        names = {pk: f"{item.content_type.app_label}.{item.codename}" for pk, item in items.items()}
    else:
        names = {pk: item.name for pk, item in item_model._base_manager.in_bulk({item for _owner, item in pairs}).items()}
    by_owner = {}
    for owner, item in pairs:
        by_owner.setdefault(owner, []).append(names.get(item, str(item)))
    for owner_pk, gained_or_lost in sorted(by_owner.items()):
        owner = owners.get(owner_pk)
        if owner is not None:
            _record(action_name, owner, {change: sorted(gained_or_lost)})
    if change == "removed":
        if owner_model is Group:
            users = get_user_model()._base_manager.filter(groups__in=list(by_owner)).values_list("pk", flat=True)
            _announce_access_changed(users)
        else:
            _announce_access_changed(by_owner)


# --- sessions and sign-ins --------------------------------------------------------------------------


def session_deleted(session):
    """Announce that the user signed in by a deleted (signed out, flushed, expired and cleared) session lost it."""
    user_id = session.get_decoded().get(SESSION_KEY)
    if user_id is not None:
        _announce_access_changed([get_user_model()._meta.pk.to_python(user_id)])


def login_record(*, request, user):
    """Audit ``user``'s sign-in with a password by ``request`` (``auth.login``)."""
    with audited_atomic():
        audit_record(
            actor=Actor.for_user(user, client_ip(request)),
            action=actions.AUTH_LOGIN,
            target_type="user",
            target_id=user.pk,
            details={"username": user.get_username(), "path": request.path},
        )


def login_failure_audit(*, action, address, details):
    """Audit a failed sign-in (``auth.login_failed``) or an address or username reaching the failure rate
    (``auth.login_throttled``). Called by ``workers.throttling`` in bounded form, never with a password."""
    with audited_atomic():
        audit_record(
            actor=Actor(ActorType.USER, "", "", address),
            action=action,
            target_type="user",
            details=details,
            success=False,
        )
