"""The shipped groups get the stored-config permissions: viewers read them, operators and admins store and edit them.

Idempotent like ``simpletuner_site``'s groups migration: it adds what is missing and takes nothing away.
"""

from django.db import migrations

from common.migration_kit import grant_group_permissions

EDITING = ("configs.view_trainingconfig", "configs.add_trainingconfig", "configs.change_trainingconfig")
GRANTS = {"viewer": ("configs.view_trainingconfig",), "operator": EDITING, "admin": EDITING}


def grant(apps, schema_editor):
    grant_group_permissions(apps, schema_editor, GRANTS, "configs")


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("configs", "0001_initial"),
        ("simpletuner_site", "0001_operator_groups"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
