"""Chain the audit rows written before the chain existed, in id order, and set the chain head."""

from django.db import migrations

from audit.chain import GENESIS, HASHED_FIELDS, chain_key, link_hash

BATCH = 2000


def chain_existing_rows(apps, schema_editor):
    AuditEvent = apps.get_model("audit", "AuditEvent")
    AuditChainHead = apps.get_model("audit", "AuditChainHead")
    key, seq, previous, last_id = chain_key(), 0, GENESIS, 0
    fields = [f for f in HASHED_FIELDS if f != "seq"]
    while True:
        rows = list(AuditEvent.objects.filter(id__gt=last_id).order_by("id").only("id", *fields)[:BATCH])
        if not rows:
            break
        for row in rows:
            seq += 1
            row.seq = seq
            previous = row.chain_hash = link_hash(key, previous, [getattr(row, f) for f in HASHED_FIELDS])
        AuditEvent.objects.bulk_update(rows, ["seq", "chain_hash"])
        last_id = rows[-1].id
    AuditChainHead.objects.update_or_create(pk=1, defaults={"seq": seq, "chain_hash": previous})


class Migration(migrations.Migration):

    dependencies = [
        ("audit", "0002_chain_fields"),
    ]

    operations = [
        migrations.RunPython(chain_existing_rows, migrations.RunPython.noop),
    ]
