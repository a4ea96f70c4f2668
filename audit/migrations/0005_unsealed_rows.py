"""Audit rows are written unsealed and sealed after commit (audit.sweeps): ``seq`` and ``chain_hash`` empty until
then, and an index of the rows still to seal. The rows already sealed keep their seq and hash as they are."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("audit", "0004_seq_unique"),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="chain_hash",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
        migrations.AlterField(
            model_name="auditevent",
            name="seq",
            field=models.BigIntegerField(blank=True, null=True, unique=True),
        ),
        migrations.AddIndex(
            model_name="auditevent",
            index=models.Index(condition=models.Q(("seq__isnull", True)), fields=["id"], name="audit_unsealed"),
        ),
    ]
