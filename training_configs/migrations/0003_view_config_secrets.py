"""The ``view_config_secrets`` permission (the values of secret keys in configs, training_configs.secrets), given to the
shipped ``admin`` group; viewers and operators see those values masked.

Idempotent like the other group migrations: it adds what is missing and takes nothing away.
"""

from django.db import migrations

from common.migration_kit import grant_group_permissions

GRANTS = {"admin": ("configs.view_config_secrets",)}


def grant(apps, schema_editor):
    grant_group_permissions(apps, schema_editor, GRANTS, "configs")


class Migration(migrations.Migration):
    dependencies = [
        ("configs", "0002_config_permissions"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="trainingconfig",
            options={
                "ordering": ["name", "-version"],
                "permissions": [("view_config_secrets", "Can view the secret values in configs and jobs' configs")],
            },
        ),
        migrations.RunPython(grant, migrations.RunPython.noop),
    ]
