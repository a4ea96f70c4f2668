"""Writing audit rows. Call inside the transaction of the change being recorded."""

import sqlite3
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.db.transaction import TransactionManagementError

from common import outbox
from common.pipeline import first_rows
from common.remote import client_ip

from .chain import GENESIS, HASHED_FIELDS, chain_key, link_hash, stored_details
from .events import announce_changes_on_commit
from .models import HEAD_ID, ActorType, AuditChainHead, AuditEvent


@dataclass(frozen=True)
class Actor:
    """Who performed an action: a user, a worker, or the system itself (sweeps, commands)."""

    type: str
    id: str = ""
    name: str = ""
    ip: str | None = None

    @classmethod
    def for_user(cls, user, ip=None):
        return cls(ActorType.USER, str(user.pk), user.get_username(), ip)

    @classmethod
    def for_worker(cls, worker, ip=None):
        return cls(ActorType.WORKER, worker.pk, worker.name, ip)

    @classmethod
    def for_request(cls, request):
        """The signed-in operator making ``request`` (API or admin), with their address."""
        return cls.for_user(request.user, client_ip(request))

    @classmethod
    def system(cls, name="system"):
        return cls(ActorType.SYSTEM, "", name, None)

    @property
    def user_id(self):
        return int(self.id) if self.type == ActorType.USER and self.id else None


def audit_record(*, actor, action, target_type="", target_id="", details=None, success=True):
    """Append one audit row for ``action`` by ``actor`` on ``target_type:target_id``; return it."""
    (event,) = audit_write(
        audit_events(actor=actor, action=action, target_type=target_type, rows=[(target_id, details)], success=success)
    )
    return event


def audit_write(events):
    """Chain unsaved audit rows onto the log, save them in one query and announce their targets at commit; return them.

    Inside an ``audit_batch()`` (``audited_atomic()``) they are held and saved with the batch's other
    rows when it ends, still in the transaction of the change they record; rows written in a savepoint
    that rolls back are dropped. Outside a transaction they are saved in their own short one.
    """
    if not events:
        return []
    batch = _batch.get()
    if batch is not None:
        batch.hold(events)
        return events
    return _append(events)


@dataclass
class _Batch:
    depth: int  # the number of atomic blocks open when it began
    held: list = field(default_factory=list)  # (savepoint marker or None, rows)

    def hold(self, events):
        marker = None
        if _atomic_depth() > self.depth:
            # Written in a savepoint: Django drops this (no-op) commit callback if the savepoint rolls back.
            marker = _SavepointMarker()
            transaction.on_commit(marker)
        self.held.append((marker, events))

    def events(self):
        """Return the held rows, less those written in a savepoint that has rolled back since."""
        alive = {id(func) for func in outbox.pending_on_commit()}
        return [e for marker, rows in self.held if marker is None or id(marker) in alive for e in rows]


class _SavepointMarker:
    def __call__(self):
        pass


_batch = ContextVar("audit_batch", default=None)


def _atomic_depth():
    return len(connection.atomic_blocks) if connection.in_atomic_block else 0


@contextmanager
def audit_batch():
    """Hold the audit rows written in the block (``audit_write``) and chain and save them in one INSERT at its end.

    Open it inside ``transaction.atomic()`` and close it before that ends (``audited_atomic()`` does
    both): the rows still commit or roll back with the change they record, and the chain's lock
    (``_append``) is the last lock the transaction takes. A block left by an exception, or whose
    transaction is marked for rollback, saves nothing. Rows written in a nested atomic block (a
    savepoint) are held too, and dropped if that savepoint rolls back; a batch opened inside a batch
    joins it. Just before the chain's lock, the transaction's outbox is staged (``outbox.stage_pending``):
    the worker events it announced are stored in it. Raise TransactionManagementError outside a transaction.
    """
    depth = _atomic_depth()
    if not depth:
        raise TransactionManagementError("audit_batch() needs a transaction: open it inside transaction.atomic()")
    if _batch.get() is not None:
        yield
        return
    batch = _Batch(depth)
    token = _batch.set(batch)
    try:
        yield
    finally:
        _batch.reset(token)
    if not transaction.get_rollback():
        outbox.stage_pending()  # what the transaction announces is written in it too, just before the chain's lock
        _append(batch.events())


@contextmanager
def audited_atomic():
    """``transaction.atomic()`` whose audit rows are chained and saved at its end (see ``audit_batch``).

    Every service transaction that writes audit rows uses it, so that the chain head is the last row
    lock a transaction takes: taking it earlier and then waiting for a row another transaction holds
    while that one waits for the head would deadlock. That includes the locks of its deferred
    foreign-key checks, run just before the head's (``_lock_head``).
    """
    with transaction.atomic(), audit_batch():
        yield


def _append(events):
    """Chain ``events`` after the head (locked until commit), save them, move the head; return them."""
    if not events:
        return []
    key = chain_key()
    for event in events:
        event.details = stored_details(event.details)
        event.client_ip = _CLIENT_IP.get_prep_value(event.client_ip) or None  # "" is stored as NULL
    with transaction.atomic(savepoint=False):
        seq, previous = _lock_head()
        for event in events:
            seq += 1
            event.seq = seq
            previous = event.chain_hash = link_hash(key, previous, [getattr(event, f) for f in HASHED_FIELDS])
        with connection.cursor() as cursor:
            if not _insert(cursor, events, head=(seq, previous)):
                cursor.execute(_MOVE_HEAD, [seq, previous, HEAD_ID])
    announce_changes_on_commit((event.target_type, event.target_id) for event in events)
    return events


_CLIENT_IP = AuditEvent._meta.get_field("client_ip")
_HEAD_TABLE = AuditChainHead._meta.db_table
_COLUMNS = (*HASHED_FIELDS, "chain_hash")
_MOVE_HEAD = f"UPDATE {_HEAD_TABLE} SET seq = %s, chain_hash = %s WHERE id = %s"
_ROWS_PER_INSERT = 500  # a multi-row VALUES: 6,000 parameters, within SQLite's 32,766 (3.32+)
# PostgreSQL: up to this many rows a multi-row VALUES, beyond it UNNEST of one array per column. A request's
# one to four rows as plain values cost its audited transaction 0.05-0.14 ms less CPU than as a dozen
# arrays (bench/audit_insert_cost.py, BENCHMARKS.md); a sweep's thousands as arrays keep the statement's
# parameters a dozen.
_ROWS_PER_VALUES_POSTGRES = 32


def _insert(cursor, events, *, head):
    """INSERT the chained ``events`` (``_COLUMNS`` set) and give each its id; return whether the chain's head was
    moved to ``head`` (``(seq, chain_hash)``) too: on PostgreSQL in the same statement (a data-modifying WITH),
    elsewhere not (the caller moves it).

    Plain SQL rather than ``bulk_create``: the values are already what the chain hashed (``created_at``,
    ``details`` and ``client_ip`` only need the backend's adaptation), and Django's per-field preparation
    of every value was most of a sweep's audit cost (BENCHMARKS.md, issue 11 re-run). A multi-row VALUES,
    ``_ROWS_PER_INSERT`` rows a statement; on PostgreSQL, beyond ``_ROWS_PER_VALUES_POSTGRES`` rows, one
    statement over ``UNNEST`` of one array per column instead (as Django's own ``bulk_create`` does
    there): a dozen parameters whatever the number of rows, so psycopg's client-side parsing of the
    query does not grow with them, while a request's few rows skip the arrays' adaptation. Ids come
    back by ``RETURNING`` where the backend has it (PostgreSQL, SQLite 3.35+), else by ``seq``, which is
    unique and, with the head locked, ours; matched by ``seq`` either way.
    """
    ops = connection.ops
    table, columns, arrays = _insert_parts(connection)
    adapt = {
        "created_at": ops.adapt_datetimefield_value,
        "details": lambda value: ops.adapt_json_value(value, None),  # the field has no encoder
        "client_ip": ops.adapt_ipaddressfield_value,
    }

    def values(event):
        return [adapt[name](getattr(event, name)) if name in adapt else getattr(event, name) for name in _COLUMNS]

    prefix, prefix_params, moved = "", [], False
    if connection.vendor == "postgresql":
        prefix, prefix_params = f"WITH moved AS ({_MOVE_HEAD}) ", [*head, HEAD_ID]
    if connection.vendor == "postgresql" and len(events) > _ROWS_PER_VALUES_POSTGRES:
        statements = [(f"SELECT * FROM UNNEST({arrays})", list(map(list, zip(*map(values, events)))), events)]
    else:
        per_insert = _ROWS_PER_INSERT
        if connection.vendor == "sqlite":  # an older SQLite allows 999 parameters per statement
            limit = connection.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
            per_insert = max(1, min(per_insert, limit // len(_COLUMNS)))
        row = "(" + ", ".join(["%s"] * len(_COLUMNS)) + ")"
        chunks = [events[start : start + per_insert] for start in range(0, len(events), per_insert)]
        statements = [
            (f"VALUES {', '.join([row] * len(chunk))}", [v for event in chunk for v in values(event)], chunk)
            for chunk in chunks
        ]
    for index, (rows, params, chunk) in enumerate(statements):
        if index:  # the head moves once, with the first statement
            prefix, prefix_params = "", []
        moved = moved or bool(prefix)
        sql, params = f"{prefix}INSERT INTO {table} ({columns}) {rows}", [*prefix_params, *params]
        if connection.features.can_return_rows_from_bulk_insert:
            cursor.execute(f"{sql} RETURNING {ops.quote_name('id')}, {ops.quote_name('seq')}", params)
        else:
            cursor.execute(sql, params)
            cursor.execute(f"SELECT id, seq FROM {table} WHERE seq BETWEEN %s AND %s", [chunk[0].seq, chunk[-1].seq])
        ids = {seq: pk for pk, seq in cursor.fetchall()}  # SQLite does not promise RETURNING's order
        for event in chunk:
            event.pk = ids[event.seq]
            event._state.adding = False
            event._state.db = connection.alias
    return moved


_INSERT_PARTS = {}


def _insert_parts(connection):
    """Return ``_insert``'s table, column list and (PostgreSQL) typed arrays for ``connection``'s backend, built once
    per backend: they never change, and deriving each column's type on every audited commit was 2% of a
    busy server's CPU."""
    parts = _INSERT_PARTS.get(connection.vendor)
    if parts is None:
        ops = connection.ops
        fields = [AuditEvent._meta.get_field(name) for name in _COLUMNS]
        parts = _INSERT_PARTS[connection.vendor] = (
            ops.quote_name(AuditEvent._meta.db_table),
            ", ".join(ops.quote_name(field.column) for field in fields),
            ", ".join(f"(%s)::{field.db_type(connection).split('(')[0]}[]" for field in fields),
        )
    return parts


def _lock_head():
    """Return the chain head's ``(seq, chain_hash)``, locked until commit.

    ``FOR UPDATE`` on PostgreSQL; SQLite's transactions hold its one write lock from BEGIN IMMEDIATE.
    (Plain SQL: this runs once per audited transaction.)

    On PostgreSQL the transaction's deferred constraint checks are run first (``SET CONSTRAINTS ALL
    IMMEDIATE``, sent in one round trip with the lock). Django makes foreign keys deferred, and the
    check of a row this transaction wrote twice (a worker drained, then moved to ``draining``) takes a
    KEY SHARE lock on the row it points to (the worker's job). Left to the commit, that lock came after
    the head's: a report holding the job's row and waiting for the head then waited on a transaction
    that waited on it (a deadlock, seen in CI). Run before the head, it keeps the head the last lock.
    """
    sql = f"SELECT seq, chain_hash FROM {_HEAD_TABLE} WHERE id = %s"
    if connection.features.has_select_for_update:
        sql += " FOR UPDATE"
    if connection.vendor == "postgresql":
        _, head = first_rows([("SET CONSTRAINTS ALL IMMEDIATE", None), (sql, [HEAD_ID])])
    else:
        with connection.cursor() as cursor:
            cursor.execute(sql, [HEAD_ID])
            head = cursor.fetchone()
    if head is None:  # a database whose head row was never made or was emptied (a test flush): resume from the last row
        last = AuditEvent.objects.order_by("-seq").values_list("seq", "chain_hash").first() or (0, GENESIS)
        AuditChainHead.objects.get_or_create(pk=HEAD_ID, defaults={"seq": last[0], "chain_hash": last[1]})
        return _lock_head()
    return head


def audit_events(*, actor, action, target_type, rows, success=True):
    """Return unsaved audit rows by ``actor``, one per ``(target_id, details)`` in ``rows``.

    For set-based writers: gather every row, then ``audit_write(...)`` them in the transaction of the
    change they record.
    """
    return [
        AuditEvent(
            actor_type=actor.type,
            actor_id=actor.id,
            actor_name=actor.name,
            action=action,
            target_type=target_type,
            target_id=str(target_id or ""),
            details=details or {},
            client_ip=actor.ip,
            success=success,
        )
        for target_id, details in rows
    ]
