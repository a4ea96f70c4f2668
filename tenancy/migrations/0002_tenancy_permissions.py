"""The shipped groups get the tenancy permissions: everyone reads teams and their own usage, operators
everyone's usage, admins manage teams and set limits (docs/teams.md).

Idempotent like ``simpletuner_site``'s groups migration: it adds what is missing and takes nothing away.
"""

from django.db import migrations

from common.migration_kit import grant_group_permissions

VIEWER = ("tenancy.view_team", "tenancy.view_limits", "tenancy.view_usage")
OPERATOR = VIEWER + ("tenancy.view_all_usage",)
ADMIN = OPERATOR + ("tenancy.add_team", "tenancy.change_team", "tenancy.delete_team", "tenancy.set_limits")
GRANTS = {"viewer": VIEWER, "operator": OPERATOR, "admin": ADMIN}


def grant(apps, schema_editor):
    grant_group_permissions(apps, schema_editor, GRANTS, "tenancy")


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("tenancy", "0001_initial"),
        ("simpletuner_site", "0001_operator_groups"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
