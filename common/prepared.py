"""Reads of the hot path compiled to SQL once, then run with each call's values.

Building and compiling a queryset (``filter``, ``annotate``, ``select_related``, the compiler's select
list, joins and WHERE clause) costs 0.5–1.4 ms on every call (``bench/prepared_cost.py``), though the
SQL is the same each time and only the values differ: under the fleet's lifecycle load, authenticating
tokens alone was 14.5% of the server's CPU. ``PreparedQuery`` keeps the ORM as the one definition of such a read: it builds the
queryset for the first call's values and for a second set derived from them, compiles both, and
learns which parameter slots carry which value (the slots equal in both are constants of the query).
Later calls execute that SQL with the new values and turn rows into model instances with the
compiler's own converters and ``select_related`` populators, as ``QuerySet.__iter__`` would.

A query whose SQL depends on the values (``None`` becomes ``IS NULL``, a list an ``IN`` of its length)
or whose values Django transforms on the way (``__icontains`` wraps them in ``%``) cannot be prepared;
``PreparedQuery`` refuses it at its first call rather than run different SQL from the ORM's. What does
shape the SQL (a choice of filters, a slice, JSON keys) is passed as positional ``shape`` arguments:
one compiled plan per shape, up to ``MAX_PLANS``; past that, calls build their queryset as the ORM would.
"""

import copy
import datetime
import threading
from dataclasses import dataclass

from django.db import connections, router
from django.db.models.query import ModelIterable, get_related_populators
from django.db.transaction import TransactionManagementError


MAX_PLANS = 256  # per PreparedQuery: shapes are few (a job target, a slice, a set of label keys)


def _identity(connection, value):
    return value


def _adapt_datetime(connection, value):
    return connection.ops.adapt_datetimefield_value(value)


def _perturbed(name, value, step):
    """A value of ``value``'s type that differs from it (by ``step``, distinct for each name)."""
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{name}: a prepared query's values must not be None or bool (they change its SQL)")
    if isinstance(value, str):
        return f"{value}\x1fprepared-{step}"
    if isinstance(value, int):
        return value + 1_000_003 * step
    if isinstance(value, datetime.datetime):
        return value + datetime.timedelta(days=step, microseconds=step)
    raise TypeError(f"{name}: a prepared query takes str, int or datetime values, not {type(value).__name__}")


def _adapters(value):
    return (_identity, _adapt_datetime) if isinstance(value, datetime.datetime) else (_identity,)


@dataclass(frozen=True)
class _Plan:
    sql: str
    slots: tuple  # per parameter: (None, constant) or (name, adapter)
    for_update: bool
    compiler: object  # the compiled query: select list, klass_info, converters' expressions
    model: type
    init_list: tuple
    fields: slice
    populators: tuple
    annotations: tuple  # (attribute, column) pairs


class _Compiled:
    """A queryset's SQL compiled once per shape, and which of its parameter slots carry which of the call's values."""

    def __init__(self, build):
        self.build = build
        self._plans = {}
        self._lock = threading.Lock()

    def _plan(self, shape, values):
        key = (shape, tuple(sorted(values)))
        prepared = self._plans.get(key)
        if prepared is None:
            with self._lock:
                prepared = self._plans.get(key)
                if prepared is None and len(self._plans) < MAX_PLANS:
                    prepared = self._plans[key] = self._prepare(shape, values)
        return prepared

    def _compile(self, shape, values):
        """Return ``(first queryset, its compiler, sql, slots, alias)`` for ``shape``, learning the slots from the
        queryset built for ``values`` and for a second set derived from them; raise TypeError where the SQL
        depends on the values, or a parameter is not one of them as given."""
        other = {name: _perturbed(name, value, step) for step, (name, value) in enumerate(sorted(values.items()), 1)}
        first, second = self.build(*shape, **values), self.build(*shape, **other)
        alias = first.db
        if alias != (router.db_for_write(first.model) if first.query.select_for_update else router.db_for_read(first.model)):
            raise TypeError("a prepared query reads the model's default database")
        compiler = first.query.get_compiler(using=alias)
        sql, params = compiler.as_sql()
        sql_other, params_other = second.query.get_compiler(using=alias).as_sql()
        if sql != sql_other or len(params) != len(params_other):
            raise TypeError(f"the query's SQL depends on its values; it cannot be prepared: {sql}")
        connection = connections[alias]
        slots = []
        for index, (value, value_other) in enumerate(zip(params, params_other)):
            if type(value) is type(value_other) and value == value_other:
                slots.append((None, value))
                continue
            found = {
                (name, adapter)
                for name in values
                for adapter in _adapters(values[name])
                if adapter(connection, values[name]) == value and adapter(connection, other[name]) == value_other
            }
            names = {name for name, _ in found}
            if len(names) != 1:
                raise TypeError(f"parameter {index} of the query ({value!r}) is not one of its values as given; it cannot be prepared")
            slots.append(min(found, key=lambda slot: slot[1] is not _identity))
        return first, compiler, sql, tuple(slots), alias

    @staticmethod
    def _params(slots, connection, values):
        return [constant if name is None else constant(connection, values[name]) for name, constant in slots]


class PreparedSQL(_Compiled):
    """``sql(*shape, **values)`` returns ``(sql, params)`` of the queryset ``build(*shape, **values)`` would run, without
    building or compiling it again: the ORM's definition of a read, to embed in a statement of its own (a
    subquery). ``shape`` and the values are as ``PreparedQuery`` takes them."""

    def sql(self, *shape, **values):
        prepared = self._plan(shape, values)
        if prepared is None:
            queryset = self.build(*shape, **values)
            return queryset.query.get_compiler(using=queryset.db).as_sql()
        sql, slots, alias = prepared
        return sql, self._params(slots, connections[alias], values)

    def _prepare(self, shape, values):
        _, _, sql, slots, alias = self._compile(shape, values)
        return sql, slots, alias


class PreparedQuery(_Compiled):
    """``build(*shape, **values)`` returns a model queryset; ``run(*shape, **values)`` returns its rows as a list
    of instances, ``first(*shape, **values)`` the first or None, without building or compiling it again.

    ``shape`` is hashable and may change the SQL; each value is a str, int or datetime and must not.
    """

    def first(self, *shape, **values):
        rows = self.run(*shape, **values)
        return rows[0] if rows else None

    def run(self, *shape, **values):
        prepared = self._plan(shape, values)
        if prepared is None:
            return list(self.build(*shape, **values))
        plan, alias = prepared
        connection = connections[alias]
        if plan.for_update and connection.features.has_select_for_update and connection.get_autocommit():
            raise TransactionManagementError("select_for_update cannot be used outside of a transaction.")
        params = self._params(plan.slots, connection, values)
        with connection.cursor() as cursor:
            cursor.execute(plan.sql, params)
            rows = cursor.fetchall()
        if not rows:
            return []
        compiler = copy.copy(plan.compiler)
        compiler.connection = connection  # the converters are this thread's connection's
        out = []
        for row in compiler.results_iter([rows]):
            obj = plan.model.from_db(alias, plan.init_list, row[plan.fields])
            for populator in plan.populators:
                populator.populate(row, obj)
            for attribute, column in plan.annotations:
                setattr(obj, attribute, row[column])
            out.append(obj)
        return out

    def _prepare(self, shape, values):
        first, compiler, sql, slots, alias = self._compile(shape, values)
        if first._iterable_class is not ModelIterable or first._prefetch_related_lookups or first._known_related_objects:
            raise TypeError("a prepared query returns model instances: no values(), prefetch_related() or known related objects")
        if compiler.has_extra_select:
            raise TypeError("a prepared query has no extra() columns")
        klass_info, select = compiler.klass_info, compiler.select
        fields = klass_info["select_fields"]
        return (
            _Plan(
                sql=sql,
                slots=slots,
                for_update=bool(first.query.select_for_update),
                compiler=compiler,
                model=klass_info["model"],
                init_list=tuple(column[0].target.attname for column in select[fields[0] : fields[-1] + 1]),
                fields=slice(fields[0], fields[-1] + 1),
                populators=tuple(get_related_populators(klass_info, select, alias)),
                annotations=tuple(compiler.annotation_col_map.items()),
            ),
            alias,
        )
