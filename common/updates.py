"""One UPDATE for a set of rows that each get their own values: what the set-based status writers issue."""

from django.db.models import Case, F, Model, Q, Value, When

# Rows per statement. Each row's key appears at most once per CASE and once in the guard, so this keeps
# a statement's parameters far below SQLite's and PostgreSQL's limits whatever the size of a sweep.
ROWS_PER_UPDATE = 1000

_KEEP = object()  # a row that does not get a field keeps its own value


def update_rows(queryset, changes, *, key="pk", expect=None):
    """Write ``changes`` (``{row key: {field: value}}``) to those rows of ``queryset`` in one UPDATE; return how many.

    A field that every row gets with the same value is set plainly; one whose value differs between
    rows (or that some rows do not get) becomes a CASE on ``key`` whose ELSE is its commonest value, and
    the rows without it keep their own. Values may be expressions (``F("n") + 1``). ``expect``
    (``{row key: {field: value}}``) guards each row: it is written only while those fields still hold
    those values (the status its writer read). Beyond ``ROWS_PER_UPDATE`` rows, one UPDATE per that many.
    """
    keys = list(changes)
    written = 0
    for start in range(0, len(keys), ROWS_PER_UPDATE):
        chunk = keys[start : start + ROWS_PER_UPDATE]
        where = _guard(chunk, key=key, expect=expect)
        written += queryset.filter(where).update(**_values(queryset.model, chunk, changes, key=key))
    return written


def _guard(keys, *, key, expect):
    """Return ``key IN keys``, each row also held to its ``expect`` values: one OR branch per distinct set of them."""
    if expect is None:
        return Q(**{f"{key}__in": keys})
    branches = _grouped((k, tuple(sorted(expect[k].items()))) for k in keys)
    guard = Q()
    for held, group in branches:
        guard |= Q(**dict(held), **{f"{key}__in": group})
    return guard


def _values(model, keys, changes, *, key):
    """Return the ``update()`` arguments writing each row's own ``changes`` among ``keys``."""
    names = dict.fromkeys(name for k in keys for name in changes[k])
    values = {}
    for name in names:
        given = [changes[k].get(name, _KEEP) for k in keys]
        first = given[0]
        if first is not _KEEP and all(value is first for value in given):  # the usual case: one object for all
            values[name] = first
            continue
        groups = _grouped(zip(keys, given))
        if len(groups) == 1 and groups[0][0] is not _KEEP:
            values[name] = groups[0][0]
            continue
        field = model._meta.get_field(name)
        groups.sort(key=lambda group: len(group[1]), reverse=True)  # the commonest value is the ELSE: no key list
        (default, _), rest = groups[0], groups[1:]
        values[name] = Case(
            *(When(Q(**{f"{key}__in": group}), then=_expression(value, field, name)) for value, group in rest),
            default=_expression(default, field, name),
            output_field=field,
        )
    return values


def _expression(value, field, name):
    if value is _KEEP:
        return F(name)
    if hasattr(value, "resolve_expression"):
        return value
    return Value(value.pk if isinstance(value, Model) else value, output_field=field)


def _grouped(pairs):
    """Return ``[(value, [keys])]`` from ``(key, value)`` pairs; two values are one if of one type and equal."""
    groups, unhashable = {}, []
    for k, value in pairs:
        try:
            groups.setdefault((type(value), value), (value, []))[1].append(k)
        except TypeError:  # a dict or a list (a JSON field): compared with each such value seen so far
            for seen, group in unhashable:
                if type(seen) is type(value) and seen == value:
                    group.append(k)
                    break
            else:
                unhashable.append((value, [k]))
    return [*groups.values(), *unhashable]

