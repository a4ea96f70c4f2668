"""Reads of teams and limits: a user's teams, the limits that apply to a job of a user and team."""

from dataclasses import dataclass, field

from django.db import connection
from django.db.models import CharField, F, IntegerField, Q, Value

from common.prepared import PreparedSQL

from .models import LIMIT_FIELDS, NO_LIMITS, LimitScope, Limits, Team


def teams_of(user):
    """Return the names of the teams ``user`` is a member of, sorted."""
    if user is None or not getattr(user, "pk", None):
        return []
    return list(Team.objects.filter(members=user).order_by("name").values_list("name", flat=True))


def limits_global():
    """Return the global limits as ``{field: figure or None}``."""
    row = Limits.objects.filter(scope=LimitScope.GLOBAL).first()
    return row.as_dict() if row else dict(NO_LIMITS)


def limits_of_team(team):
    row = Limits.objects.filter(team=team).first() if team is not None else None
    return row.as_dict() if row else dict(NO_LIMITS)


def limits_of_user(user):
    row = Limits.objects.filter(user=user).first() if user is not None else None
    return row.as_dict() if row else dict(NO_LIMITS)


@dataclass
class Submitter:
    """What a submit needs to know of its user: their teams with each one's limits, the user's and the
    fleet's limits (``{field: figure or None}`` each)."""

    teams: dict = field(default_factory=dict)  # name -> (team id, limits)
    user_limits: dict = field(default_factory=lambda: dict(NO_LIMITS))
    global_limits: dict = field(default_factory=lambda: dict(NO_LIMITS))

    def limits(self, team_name):
        """Return ``[(scope, name, {field: figure})]``: the limits that apply to a job of this user and ``team_name``."""
        found = [(LimitScope.GLOBAL, "the fleet", self.global_limits), (LimitScope.USER, None, self.user_limits)]
        if team_name is not None:
            found.append((LimitScope.TEAM, team_name, self.teams[team_name][1]))
        return found


def _submitter_rows(*, user_id):
    """The user's teams with their limits, and the user's and the fleet's limits: ``(scope, team id, team name,
    *figures)`` rows, one statement."""
    figures = [F(f"limits__{name}") for name in LIMIT_FIELDS]
    teams = Team.objects.filter(members__id=user_id).order_by().values_list(Value(LimitScope.TEAM, output_field=CharField()), "id", "name", *figures)
    others = Limits.objects.filter(Q(scope=LimitScope.GLOBAL) | Q(user_id=user_id)).values_list(
        "scope", Value(None, output_field=IntegerField()), Value("", output_field=CharField()), *LIMIT_FIELDS
    ).order_by()
    return teams.union(others, all=True)


# Every submit reads it: compiled once (building and compiling the union cost about 1 ms a submit).
_SUBMITTER_ROWS = PreparedSQL(_submitter_rows)


def submitter(user_id):
    """Return the ``Submitter`` of user ``user_id`` (None: a system actor), in one query."""
    found = Submitter()
    if user_id is None:
        found.global_limits = limits_global()
        return found
    sql, params = _SUBMITTER_ROWS.sql(user_id=int(user_id))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    for scope, team_id, name, *values in rows:
        limits = dict(zip(LIMIT_FIELDS, values))
        if scope == LimitScope.TEAM:
            found.teams[name] = (team_id, limits)
        elif scope == LimitScope.USER:
            found.user_limits = limits
        else:
            found.global_limits = limits
    return found
