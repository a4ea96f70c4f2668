"""Every audit row has its unique place in the chain."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("audit", "0003_chain_existing_rows"),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="seq",
            field=models.BigIntegerField(unique=True),
        ),
    ]
