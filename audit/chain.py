"""The audit chain's arithmetic: the keyed hash linking each audit row to the one before it.

Pure functions, no queries: the sealer (``audit.sweeps``), the data migration that chained the rows
written before the chain existed, and ``verify_audit`` (``audit.selectors``) all hash with these, each
over a row's values as read back from the database.

A row's ``chain_hash`` is HMAC-SHA256, under ``settings.SIMPLETUNER_AUDIT_KEY``, of the previous row's
``chain_hash`` followed by the row's canonical form: a compact JSON array of ``HASHED_FIELDS`` in that
order, ``created_at`` in UTC with microseconds, ``details`` with sorted keys and every integral float
written as the integer it equals (so a value hashes the same before and after a PostgreSQL ``jsonb``
round trip, which turns ``1e+16`` into ``10000000000000000``), ``client_ip`` as the database stores it.
"""

import hmac
import json
from datetime import timezone as dt_timezone
from decimal import Decimal

from django.conf import settings

GENESIS = "0" * 64  # the "previous hash" of the first row
HASHED_FIELDS = (
    "seq", "created_at", "actor_type", "actor_id", "actor_name", "action",
    "target_type", "target_id", "details", "client_ip", "success",
)  # fmt: skip

_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


def chain_key():
    """Return the key rows are hashed with now, as bytes."""
    return settings.SIMPLETUNER_AUDIT_KEY.encode()


def _plain(value):
    """Return ``value`` with every integral float replaced by the integer its decimal text names."""
    kind = type(value)
    if kind is float:
        return int(Decimal(repr(value))) if value.is_integer() else value
    if kind is dict:
        return {k: _plain(v) for k, v in value.items()}
    if kind is list:
        return [_plain(v) for v in value]
    return value


def link_hash(key, previous, row):
    """Return the chain hash of ``row`` (values in ``HASHED_FIELDS`` order, as read from the database) after ``previous``."""
    seq, created_at, actor_type, actor_id, actor_name, action, target_type, target_id, details, client_ip, success = row
    body = _dumps(
        [
            seq,
            created_at.astimezone(dt_timezone.utc).isoformat(timespec="microseconds"),
            actor_type, actor_id, actor_name, action, target_type, target_id,
            _plain(details),
            client_ip,
            bool(success),
        ]
    )  # fmt: skip
    return hmac.digest(key, (previous + body).encode(), "sha256").hex()
