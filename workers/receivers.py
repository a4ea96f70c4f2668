"""The account signals' receivers: thin hand-offs to ``workers.accounts`` and ``workers.throttling``."""

from django.contrib.auth import get_user_model, user_logged_in, user_login_failed
from django.contrib.auth.models import Group
from django.contrib.sessions.models import Session
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_delete, pre_save

from . import accounts, throttling


def connect():
    """Connect the receivers and make users' and groups' saves atomic with their audit rows (idempotent)."""
    for model in (get_user_model(), Group):
        pre_save.connect(_before_save, sender=model, dispatch_uid=f"account-before-save-{model.__name__}")
        post_save.connect(_saved, sender=model, dispatch_uid=f"account-saved-{model.__name__}")
        pre_delete.connect(_before_delete, sender=model, dispatch_uid=f"account-before-delete-{model.__name__}")
        post_delete.connect(_deleted, sender=model, dispatch_uid=f"account-deleted-{model.__name__}")
    for through in accounts.relation_through_models():
        m2m_changed.connect(_relation_changed, sender=through, dispatch_uid=f"account-relation-{through.__name__}")
    post_delete.connect(_session_deleted, sender=Session, dispatch_uid="account-session-deleted")
    user_logged_in.connect(_logged_in, dispatch_uid="account-logged-in")
    user_login_failed.connect(_login_failed, dispatch_uid="account-login-failed")
    accounts.atomic_saves(get_user_model(), Group)


def _before_save(sender, instance, raw=False, update_fields=None, **kwargs):
    if not raw:  # fixtures (loaddata) are not account changes
        accounts.account_before_save(instance, update_fields)


def _saved(sender, instance, created, raw=False, **kwargs):
    if not raw:
        accounts.account_saved(instance, created=created)


def _before_delete(sender, instance, **kwargs):
    accounts.account_before_delete(instance)


def _deleted(sender, instance, **kwargs):
    accounts.account_deleted(instance)


def _relation_changed(sender, instance, action, reverse, pk_set, **kwargs):
    accounts.relation_changed(through=sender, instance=instance, action=action, reverse=reverse, pk_set=pk_set)


def _session_deleted(sender, instance, **kwargs):
    accounts.session_deleted(instance)


def _logged_in(sender, request, user, **kwargs):
    if request is not None:
        accounts.login_record(request=request, user=user)


def _login_failed(sender, credentials, request=None, **kwargs):
    if request is not None:  # authenticate() called without a request (a script) is no sign-in
        throttling.login_failed(request, credentials.get(get_user_model().USERNAME_FIELD) or "")
