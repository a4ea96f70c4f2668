"""The shipped admin group gets the webhook permissions: webhooks are admin-level configuration (a URL can be a
credential, and deliveries carry job and worker data out). Viewers and operators get none.

Idempotent like ``simpletuner_site``'s groups migration: it adds what is missing and takes nothing away.
"""

from django.db import migrations

from common.migration_kit import grant_group_permissions

GRANTS = {
    "admin": (
        "webhooks.view_webhook",
        "webhooks.add_webhook",
        "webhooks.change_webhook",
        "webhooks.delete_webhook",
        "webhooks.redeliver_webhook",
    ),
}


def grant(apps, schema_editor):
    grant_group_permissions(apps, schema_editor, GRANTS, "webhooks")


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("webhooks", "0001_initial"),
        ("simpletuner_site", "0001_operator_groups"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
