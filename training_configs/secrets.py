"""Secrets in configs: which keys hold one, and a config as a reader without the view-secrets permission sees it.

A key is secret when its name matches one of ``SIMPLETUNER_SECRET_CONFIG_KEYS``' patterns (default
``*token*``, ``*secret*``, ``*password*``, ``*key*``), case-insensitively, at any depth of a config or a
dataloader. Every place that shows a config to a person (the API and the admin, stored configs and jobs')
shows it through ``config_shown``; what is sent to the agent (``job_submit``, the worker API) is never masked.
"""

from fnmatch import fnmatchcase

from django.conf import settings

from common.permissions import may

from .permissions import VIEW_SECRETS

MASK = "********"  # what a secret's value is shown as


def secret_key(key):
    """Return whether a config key named ``key`` holds a secret."""
    name = str(key).lower()
    return any(fnmatchcase(name, pattern) for pattern in settings.SIMPLETUNER["SECRET_CONFIG_KEYS"])


def may_view_secrets(user):
    """Return whether ``user`` may read the values of secret keys."""
    return may(user, VIEW_SECRETS)


def config_shown(value, *, reveal):
    """Return config or dataloader ``value`` as a reader sees it: whole when ``reveal``, else with the value of
    every secret key, at any depth (in lists too), replaced by MASK. ``value`` itself is never changed."""
    if reveal:
        return value
    if isinstance(value, dict):
        return {key: MASK if secret_key(key) else config_shown(item, reveal=False) for key, item in value.items()}
    if isinstance(value, list):
        return [config_shown(item, reveal=False) for item in value]
    return value


def config_unmasked(submitted, stored):
    """Return ``submitted`` (a config edited from its masked form) with each secret key still holding MASK given
    ``stored``'s value at the same place again, so saving a form without touching a secret keeps it."""
    if isinstance(submitted, dict):
        known = stored if isinstance(stored, dict) else {}
        return {
            key: known[key] if secret_key(key) and item == MASK and key in known else config_unmasked(item, known.get(key))
            for key, item in submitted.items()
        }
    if isinstance(submitted, list):
        known = stored if isinstance(stored, list) else []
        return [config_unmasked(item, known[i] if i < len(known) else None) for i, item in enumerate(submitted)]
    return submitted
