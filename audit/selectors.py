"""Reading the audit log: checking its chain (``audit_chain_verify``, behind ``manage.py verify_audit``) and what is
not sealed into it yet (``audit_unsealed``)."""

from dataclasses import dataclass, field

from django.db.models import Count, Max, Min

from .chain import GENESIS, HASHED_FIELDS, chain_key, link_hash
from .models import HEAD_ID, AuditChainHead, AuditEvent

CHUNK = 5000


@dataclass(frozen=True)
class ChainFault:
    kind: str  # "broken": a row's hash does not match it (edited); "missing": no row at this seq (deleted)
    seq: int
    row_id: int | None = None
    created_at: object = None
    detail: str = ""


@dataclass
class ChainReport:
    checked: int = 0  # links recomputed
    first_seq: int | None = None
    last_seq: int | None = None
    faults: list = field(default_factory=list)  # the first FAULT_LIMIT faults, in seq order
    fault_count: int = 0
    unsealed: int = 0  # rows written but not sealed yet (not checked: they are not in the chain yet)
    oldest_unsealed: object = None  # the created_at of the oldest of them

    @property
    def intact(self):
        return self.fault_count == 0

    def fault(self, *args, **kwargs):
        self.fault_count += 1
        if len(self.faults) < FAULT_LIMIT:
            self.faults.append(ChainFault(*args, **kwargs))


FAULT_LIMIT = 20


def audit_unsealed():
    """Return ``(count, oldest created_at or None)`` of the audit rows the sealer has not sealed yet."""
    found = AuditEvent.objects.filter(seq__isnull=True).aggregate(n=Count("*"), oldest=Min("created_at"))
    return found["n"], found["oldest"]


def audit_chain_verify(*, since=None, until=None):
    """Recompute every link of the sealed audit chain in seq order; return a ChainReport.

    ``since`` (inclusive) and ``until`` (exclusive) bound the rows checked by ``created_at``: from the
    first row at or after ``since`` (its predecessor's stored hash is the anchor) to the last row
    before ``until``; without ``until``, to the chain head read at the start (rows written meanwhile
    are not checked), so rows deleted from the end are found too. A link is broken when a row's
    hash differs from the one recomputed from its contents and its predecessor's stored hash, and
    missing when a seq has no row. Rows not sealed yet are counted (``unsealed``, ``oldest_unsealed``),
    not checked.
    """
    report = ChainReport()
    report.unsealed, report.oldest_unsealed = audit_unsealed()
    head = AuditChainHead.objects.filter(pk=HEAD_ID).values_list("seq", "chain_hash").first()
    rows = AuditEvent.objects.all()
    start = rows.filter(created_at__gte=since).aggregate(s=Min("seq"))["s"] if since else 1
    if until is not None:
        end = rows.filter(created_at__lt=until).aggregate(s=Max("seq"))["s"]
    else:
        end = head[0] if head else rows.aggregate(s=Max("seq"))["s"]
    if start is None or end is None or end < start:
        return report
    previous = GENESIS
    if start > 1:
        anchor = rows.filter(seq=start - 1).values_list("chain_hash", flat=True).first()
        if anchor is None:
            report.fault("missing", start - 1, detail="the anchor of the range (the row before its first) is missing")
        previous = anchor
    key, expected = chain_key(), start
    last = None
    # Without --since every row up to the end is read, so that a row slipped in before seq 1 is found too.
    walk = (
        (rows.filter(seq__gte=start, seq__lte=end) if since else rows.filter(seq__lte=end))
        .order_by("seq")
        .values_list("id", *HASHED_FIELDS, "chain_hash")
        .iterator(chunk_size=CHUNK)
    )
    for row in walk:
        row_id, seq, stored = row[0], row[1], row[-1]
        if seq < expected:  # only before seq 1: seq is unique
            report.fault("broken", seq, row_id, row[2], "a row outside the chain (before its first)")
            continue
        if seq != expected:
            between = f"after id {last[0]}" if last else "before the first row checked"
            report.fault("missing", expected, detail=f"seq {expected}-{seq - 1} ({seq - expected} rows) missing, {between}")
            previous = None
        if previous is not None:
            report.checked += 1
            if link_hash(key, previous, row[1:-1]) != stored:
                report.fault("broken", seq, row_id, row[2], "its hash does not match its contents and predecessor")
        previous, expected, last = stored, seq + 1, row
    if expected <= end:
        report.fault("missing", expected, detail=f"seq {expected}-{end} ({end - expected + 1} rows) missing at the end")
    elif until is None and head and last is not None and head[1] != last[-1]:
        report.fault("broken", head[0], detail="the chain head does not match the last row's hash")
    report.first_seq, report.last_seq = start, end
    return report
