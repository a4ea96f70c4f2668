"""Every write to stored configs: a new version, an edit (a new version once used), marking a version used,
and resolving the config a submitted job runs."""

import re

from django.conf import settings
from django.db import IntegrityError
from django.db.models import Max
from django.utils import timezone

from audit import actions
from audit.services import audit_record, audited_atomic
from common.errors import InvalidInput
from common.inputs import name_problem
from common.prepared import PreparedQuery

from .models import NAME_MAX_CHARS, NAME_PATTERN, VERSION_SEPARATOR, TrainingConfig
from .selectors import config_names, config_resolve


# Every submit of a stored config locks its version: compiled once.
_LOCK_VERSION = PreparedQuery(lambda *, pk: TrainingConfig.objects.select_for_update().filter(pk=pk)[:1])


def check_name(name):
    """Raise InvalidInput unless ``name`` can name a stored config."""
    if not name or len(name) > NAME_MAX_CHARS or not re.fullmatch(NAME_PATTERN, name):
        raise InvalidInput(
            f"a config name is 1-{NAME_MAX_CHARS} printable ASCII characters without '{VERSION_SEPARATOR}', '/' "
            "or surrounding spaces",
            code="invalid_config_name",
        )


def _audit(action, config, actor, **details):
    audit_record(
        actor=actor,
        action=action,
        target_type="config",
        target_id=str(config.pk),  # the name (up to 200 characters) is in details: an audit target id is at most 64
        details={"name": config.name, "version": config.version, **details},
    )


def config_create(*, name, config, actor, dataloader=None, description=""):
    """Store ``config`` as the next version of ``name`` (version 1 for a new name); return it."""
    check_name(name)
    for _ in range(3):  # two creators of the same name at once: the unique constraint decides, the loser retries
        try:
            with audited_atomic():
                latest = TrainingConfig.objects.filter(name=name).aggregate(top=Max("version"))["top"] or 0
                created = TrainingConfig.objects.create(
                    name=name,
                    version=latest + 1,
                    config=config or {},
                    dataloader=dataloader,
                    description=description or "",
                    owner_id=actor.user_id,
                )
                _audit(actions.CONFIG_CREATED, created, actor)
            return created
        except IntegrityError:
            continue
    raise InvalidInput(f"config {name} is being changed concurrently; try again", code="config_busy")


def config_edit(*, config_id, config, dataloader, description, actor):
    """Change stored version ``config_id``: in place while no job has used it, else as the next version.

    Return ``(the version holding the change, whether it is a new version)``.
    """
    with audited_atomic():
        current = TrainingConfig.objects.select_for_update().get(pk=config_id)
        if current.immutable:
            new = True
        else:
            new = False
            TrainingConfig.objects.filter(pk=current.pk).update(config=config or {}, dataloader=dataloader, description=description or "")
            current.refresh_from_db()
            _audit(actions.CONFIG_UPDATED, current, actor)
    if new:
        return config_create(name=current.name, config=config, dataloader=dataloader, description=description, actor=actor), True
    return current, False


def config_for_submit(*, config_name, config, dataloader):
    """Return ``(name, config, dataloader, stored version or None)`` for a job submitted with ``config_name``.

    A stored name (``name`` or ``name@version``) gives its config with the inline ``config``'s keys over it,
    and its dataloader unless one is given. A name not stored is taken as it is, unless
    ``SIMPLETUNER_REQUIRE_STORED_CONFIG`` is on: then InvalidInput (400 ``config_not_stored``) lists the
    stored names; a name holding a format control (``common.inputs.name_problem``) is InvalidInput
    (``invalid_config_name``). Call in the submit's transaction, which marks the version used (``config_mark_used``):
    the version is locked until that transaction ends, so the job's recorded version holds the content it runs.
    """
    problem = name_problem(config_name)
    if problem:
        raise InvalidInput(f"config_name {problem}", code="invalid_config_name")
    stored = config_resolve(config_name)
    if stored is None:
        if settings.SIMPLETUNER["REQUIRE_STORED_CONFIG"]:
            names = config_names()
            raise InvalidInput(
                f"config {config_name!r} is not stored; stored configs: {', '.join(names) if names else 'none'}",
                code="config_not_stored",
                extra={"stored_configs": names},
            )
        return config_name, config or {}, dataloader, None
    # Read again under the version's row lock, held until the submit commits: an edit of the version waits for
    # it and then finds it used (a new version), or has committed before and its content is what is read here.
    stored = _LOCK_VERSION.first(pk=stored.pk)
    merged = {**(stored.config or {}), **(config or {})}
    return stored.name, merged, dataloader if dataloader is not None else stored.dataloader, stored


def config_mark_used(config, *, now=None):
    """Record that a job used ``config`` (from now on it is immutable)."""
    if config is not None and config.used_at is None:
        TrainingConfig.objects.filter(pk=config.pk, used_at__isnull=True).update(used_at=now or timezone.now())
