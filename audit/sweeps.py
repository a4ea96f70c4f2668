"""The audit sealer: gives each committed audit row its place in the chain (``seq``) and its HMAC link.

A request saves its audit rows unsealed, in its own transaction, and takes no lock that another
request's needs (``audit.services``). ``seal_chain`` chains them afterwards, one sealer at a time in
the whole deployment: a pass locks the chain's head row (``AuditChainHead``: ``SELECT ... FOR
UPDATE`` on PostgreSQL; on SQLite the write lock its transaction takes at ``BEGIN IMMEDIATE``), which
nothing but a sealer locks.

The order: ids are handed out at INSERT, not at commit, so a row with a lower id can commit after
rows with higher ids were sealed. A pass therefore seals, in id order, the rows it finds with no
``seq`` (the partial index ``audit_unsealed``), which are the rows committed before it read them, not
"the ids above the last one sealed": a row that commits later, whatever its id, is found by the next
pass and sealed after every row sealed before. No committed row is left unsealed, and a row sealed
in a later pass committed after every row of the earlier passes had.

When: after every audited commit, ``seal_after_commit`` wakes this process's sealer thread, which
runs ``seal_chain`` and then rests ``SEAL_PAUSE``, so that the rows of the commits of that time are
sealed together, in one pass; and the scheduler that runs the sweeps (Celery beat, or the embedded
scheduler without a broker) runs ``seal_chain`` every ``SEAL_INTERVAL`` seconds, which seals the rows
of a process that stopped before its thread did.
"""

from django.db import connection, transaction

from common.background import WokenThread

from .chain import GENESIS, HASHED_FIELDS, chain_key, link_hash
from .models import HEAD_ID, AuditChainHead, AuditEvent

# Seconds between the scheduler's runs of seal_chain: a row whose commit woke no sealer (its process
# stopped first) is sealed within this, which keeps the sealing lag's target (1 s).
SEAL_INTERVAL = 1
# Seconds a process's sealer thread rests after a pass before it answers the next wake: under load, the
# commits of that time are sealed in one pass (one transaction) rather than one pass each.
SEAL_PAUSE = 0.1
# Rows sealed per pass (one transaction): the pass holds the head, and on SQLite the write lock, this long.
SEAL_BATCH = 1000

_SEALED_FIELDS = HASHED_FIELDS[1:]  # what the sealer reads of a row; seq is what it gives


def seal_chain(*, batch=SEAL_BATCH):
    """Seal every committed audit row that has no ``seq`` yet, in passes of at most ``batch`` rows.

    Return ``{"sealed": n}``. Run it outside any transaction (each pass commits what it sealed before
    it lets the next sealer in); several at once, in any processes, take turns.
    """
    sealed = 0
    while AuditEvent.objects.filter(seq__isnull=True).exists():  # a look without the head's lock
        count = _seal_pass(batch)
        sealed += count
        if count < batch:
            break
    return {"sealed": sealed}


def _seal_pass(batch):
    """Lock the head, chain the first ``batch`` unsealed rows in id order after it, move it; return how many."""
    key = chain_key()
    with transaction.atomic(durable=True):
        seq, previous = _lock_head()
        rows = (
            AuditEvent.objects.filter(seq__isnull=True)
            .order_by("id")
            .values_list("id", *_SEALED_FIELDS)[:batch]
        )
        links = []
        for row_id, *fields in rows:
            seq += 1
            previous = link_hash(key, previous, [seq, *fields])
            links.append((seq, previous, row_id))
        if links:
            with connection.cursor() as cursor:
                cursor.executemany(_SEAL_ROW, links)
                cursor.execute(_MOVE_HEAD, [seq, previous, HEAD_ID])
    return len(links)


_TABLE = AuditEvent._meta.db_table
_HEAD_TABLE = AuditChainHead._meta.db_table
# Plain SQL: the model's queryset refuses updates (the trail is append-only); sealing is the one write.
_SEAL_ROW = f"UPDATE {_TABLE} SET seq = %s, chain_hash = %s WHERE id = %s AND seq IS NULL"
_MOVE_HEAD = f"UPDATE {_HEAD_TABLE} SET seq = %s, chain_hash = %s WHERE id = %s"


def _lock_head():
    """Return the chain head's ``(seq, chain_hash)``, locked until the transaction ends (the sealers' turn)."""
    head = AuditChainHead.objects.select_for_update().filter(pk=HEAD_ID).values_list("seq", "chain_hash").first()
    if head is None:  # a database whose head row was never made or was emptied (a test flush): resume from the last row
        last = AuditEvent.objects.filter(seq__isnull=False).order_by("-seq").values_list("seq", "chain_hash").first()
        AuditChainHead.objects.get_or_create(pk=HEAD_ID, defaults=dict(zip(("seq", "chain_hash"), last or (0, GENESIS))))
        return _lock_head()
    return head


SEALER = WokenThread(
    "audit-sealer",
    seal_chain,
    failed="audit sealing failed; the next commit or the scheduled run seals those rows",
    pause=SEAL_PAUSE,
)


def seal_after_commit():
    """Wake this process's sealer when the current transaction commits (at once outside a transaction)."""
    transaction.on_commit(SEALER.wake, robust=True)
