"""Every write to teams and limits: create, change members, delete a team; set the limits of a scope.
And the team a submitted job is charged to."""

import math
import re

from django.contrib.auth import get_user_model
from django.db import IntegrityError

from audit import actions
from audit.services import audit_record, audited_atomic
from common.errors import Conflict, InvalidInput, NotFound, ServiceError
from common.permissions import may

from .models import (
    GPU_HOURS_MAX,
    LIMIT_FIELDS,
    MAX_GPUS_MAX,
    MAX_RUNNING_JOBS_MAX,
    TEAM_NAME_MAX_CHARS,
    TEAM_NAME_PATTERN,
    LimitScope,
    Limits,
    Team,
)
from .permissions import OPERATOR_PRIORITY_CEILING, PRIORITIZE_JOBS, PRIORITIZE_JOBS_ANY

MEMBERS_MAX = 1000
_BOUNDS = {"max_running_jobs": MAX_RUNNING_JOBS_MAX, "max_gpus": MAX_GPUS_MAX, "gpu_hours_per_30_days": GPU_HOURS_MAX}


class Forbidden(ServiceError):
    status_code = 403
    code = "permission_denied"


def _invalid(field, message, code="invalid"):
    return InvalidInput(f"{field}: {message}", code=code, extra={"errors": {field: [message]}})


def check_team_name(name):
    """Raise InvalidInput (naming ``name``) unless ``name`` can name a team."""
    if not isinstance(name, str) or not re.fullmatch(TEAM_NAME_PATTERN, name):
        raise _invalid(
            "name", f"a team name is 1-{TEAM_NAME_MAX_CHARS} of A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )


def check_limits(values, *, partial=False):
    """Return ``values`` as the limits they set; raise InvalidInput naming the first bad field.

    Each of LIMIT_FIELDS is a whole number (``gpu_hours_per_30_days``: any number) from 0 to its bound, or
    null (no limit). Unless ``partial``, a field left out is null.
    """
    if not isinstance(values, dict):
        raise _invalid("limits", "must be an object")
    unknown = sorted(set(values) - set(LIMIT_FIELDS))
    if unknown:
        raise _invalid(unknown[0], f"Unknown field: limits take {', '.join(LIMIT_FIELDS)}.")
    clean = {} if partial else dict.fromkeys(LIMIT_FIELDS)
    for name, value in values.items():
        if value is not None:
            whole = name != "gpu_hours_per_30_days"
            kind_ok = isinstance(value, int) if whole else isinstance(value, (int, float))
            if isinstance(value, bool) or not kind_ok or (not whole and not math.isfinite(value)):
                raise _invalid(name, f"must be {'a whole number' if whole else 'a number'} or null")
            if not 0 <= value <= _BOUNDS[name]:
                raise _invalid(name, f"must be from 0 to {_BOUNDS[name]:g}, or null for no limit")
        clean[name] = value
    return clean


def _users(usernames):
    """Return the users named ``usernames``; raise NotFound naming the unknown ones."""
    if not isinstance(usernames, list) or not all(isinstance(n, str) for n in usernames):
        raise _invalid("members", "must be a list of usernames")
    if len(usernames) > MEMBERS_MAX:
        raise _invalid("members", f"at most {MEMBERS_MAX} members")
    users = list(get_user_model().objects.filter(username__in=set(usernames)))
    missing = sorted(set(usernames) - {u.get_username() for u in users})
    if missing:  # a name of nothing, as a team or a job that does not exist: 404, naming the field
        message = f"no such user: {', '.join(missing)[:300]}"
        raise NotFound(f"members: {message}", code="unknown_user", extra={"errors": {"members": [message]}})
    return users


def _team(name, *, lock=False):
    rows = Team.objects.select_for_update() if lock else Team.objects
    team = rows.filter(name=name).first() if isinstance(name, str) else None
    if team is None:
        raise NotFound(f"no team named {str(name)[:100]!r}")
    return team


def team_create(*, name, actor, members=()):
    """Create team ``name`` with ``members`` (usernames); return it. Raise InvalidInput, or Conflict if it exists."""
    check_team_name(name)
    users = _users(list(members))
    try:
        with audited_atomic():
            team = Team.objects.create(name=name)
            team.members.set(users)
            audit_record(
                actor=actor, action=actions.TEAM_CREATED, target_type="team", target_id=str(team.pk),
                details={"name": name, "members": sorted(u.get_username() for u in users)},
            )
    except IntegrityError:
        raise Conflict(f"team {name} already exists", code="team_exists") from None
    return team


def team_update(*, name, actor, members=None, limits=None):
    """Replace team ``name``'s ``members`` (usernames) and/or change its ``limits`` (the given fields); return it.

    Changing limits is the caller's to permit (``tenancy.set_limits``). Raise NotFound or InvalidInput,
    changing nothing.
    """
    users = _users(members) if members is not None else None
    clean = check_limits(limits, partial=True) if limits is not None else None
    with audited_atomic():
        team = _team(name, lock=True)
        if users is not None:
            before = sorted(team.members.values_list("username", flat=True))
            team.members.set(users)
            after = sorted(u.get_username() for u in users)
            if before != after:
                audit_record(
                    actor=actor, action=actions.TEAM_MEMBERS_CHANGED, target_type="team", target_id=str(team.pk),
                    details={"name": team.name, "before": before, "after": after},
                )
        if clean:
            _limits_write(LimitScope.TEAM, team=team, values=clean, actor=actor, label=team.name)
    return team


def team_delete(*, name, actor):
    """Delete team ``name``. Raise NotFound, or Conflict (``team_in_use``) while a job of it is not finished."""
    with audited_atomic():
        team = _team(name, lock=True)
        unfinished = team.jobs.filter(finished_at__isnull=True).count()
        if unfinished:
            raise Conflict(
                f"team {team.name} has {unfinished} queued or running job(s); delete it once they have finished",
                code="team_in_use",
                extra={"unfinished_jobs": unfinished},
            )
        audit_record(
            actor=actor, action=actions.TEAM_DELETED, target_type="team", target_id=str(team.pk),
            details={"name": team.name, "members": sorted(team.members.values_list("username", flat=True))},
        )
        team.delete()


def limits_set(*, scope, actor, values, team=None, username=None):
    """Set the limits of ``scope`` (global, a team by name, a user by username) to ``values`` (every field; one
    left out is no limit); return them. Raise NotFound or InvalidInput, changing nothing."""
    clean = check_limits(values)
    with audited_atomic():
        if scope == LimitScope.TEAM:
            owner = {"team": _team(team, lock=True)}
            label = team
        elif scope == LimitScope.USER:
            user = get_user_model().objects.filter(username=username).first() if isinstance(username, str) else None
            if user is None:
                raise NotFound(f"no user named {str(username)[:100]!r}")
            owner, label = {"user": user}, username
        else:
            owner, label = {}, "global"
        return _limits_write(scope, values=clean, actor=actor, label=label, **owner)


def _limits_write(scope, *, values, actor, label, team=None, user=None):
    """Write ``values`` over the limits of one scope, audited with the figures before and after; return them."""
    lookup = {"team": team} if team else {"user": user} if user else {"scope": LimitScope.GLOBAL}
    row = Limits.objects.select_for_update().filter(**lookup).first()
    if row is None:
        row = Limits.objects.create(scope=scope, team=team, user=user)
    before = row.as_dict()
    for name, value in values.items():
        setattr(row, name, value)
    row.save()
    after = row.as_dict()
    if before != after:
        audit_record(
            actor=actor, action=actions.LIMITS_CHANGED, target_type=f"limits_{scope}", target_id=str(row.pk),
            details={"scope": scope, "name": label, "before": before, "after": after},
        )
    return after


def team_for_submit(*, submitter, team_name=None):
    """Return the name of the team a job of ``submitter`` (``selectors.submitter``) is charged to, or None.

    Named: the user must be a member (Forbidden, 403 ``not_a_team_member``; NotFound for no such team). Not
    named: the user's one team; none if they are in none; InvalidInput (400 ``team_required``) listing them
    if they are in several.
    """
    names = sorted(submitter.teams)
    if team_name is not None:
        if team_name in submitter.teams:
            return team_name
        _team(team_name)  # NotFound for no such team
        raise Forbidden(f"you are not a member of team {team_name}", code="not_a_team_member")
    if len(names) > 1:
        raise InvalidInput(
            f"you are in several teams ({', '.join(names)}); name one with \"team\"",
            code="team_required",
            extra={"teams": names},
        )
    return names[0] if names else None


def priority_check(*, user, priority):
    """Raise Forbidden (403 ``permission_denied``) unless ``user`` may submit a job of ``priority``: any user up
    to 0, ``tenancy.prioritize_jobs`` up to OPERATOR_PRIORITY_CEILING, ``tenancy.prioritize_jobs_any`` beyond.
    Checked where an operator submits (the API, the admin's form), as their other permissions are."""
    if priority is None or priority <= 0 or may(user, PRIORITIZE_JOBS_ANY):
        return
    if priority <= OPERATOR_PRIORITY_CEILING and may(user, PRIORITIZE_JOBS):
        return
    needed = PRIORITIZE_JOBS if priority <= OPERATOR_PRIORITY_CEILING else PRIORITIZE_JOBS_ANY
    raise Forbidden(
        f"You need the {needed} permission to submit a job with priority {priority} "
        f"({PRIORITIZE_JOBS} allows up to {OPERATOR_PRIORITY_CEILING})"
    )
