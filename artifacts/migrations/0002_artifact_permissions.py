"""The shipped groups get the artifact permissions: viewers see artifacts, operators and admins download them.

Idempotent like ``simpletuner_site``'s groups migration: it adds what is missing and takes nothing away.
"""

from django.db import migrations

from common.migration_kit import grant_group_permissions

GRANTS = {
    "viewer": ("artifacts.view_artifact", "artifacts.view_checkpoint"),
    "operator": ("artifacts.view_artifact", "artifacts.view_checkpoint", "artifacts.download_artifact"),
    "admin": ("artifacts.view_artifact", "artifacts.view_checkpoint", "artifacts.download_artifact"),
}


def grant(apps, schema_editor):
    grant_group_permissions(apps, schema_editor, GRANTS, "artifacts")


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("artifacts", "0001_initial"),
        ("simpletuner_site", "0001_operator_groups"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
