"""The audit chain's columns (``seq`` nullable until the rows already there are chained) and its head."""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("audit", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="AuditChainHead",
            fields=[
                ("id", models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False)),
                ("seq", models.BigIntegerField(default=0)),
                ("chain_hash", models.CharField(max_length=64)),
            ],
        ),
        migrations.AddField(
            model_name="auditevent",
            name="chain_hash",
            field=models.CharField(default="", max_length=64),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="auditevent",
            name="seq",
            field=models.BigIntegerField(null=True),
        ),
        migrations.AlterField(
            model_name="auditevent",
            name="created_at",
            field=models.DateTimeField(db_index=True, default=django.utils.timezone.now),
        ),
    ]
