"""The permission groups an operator team needs: viewer, operator, admin (docs/api.md, "Permissions").

Idempotent: run again, it adds what is missing and takes nothing away, so permissions an
administrator added to these groups stay.
"""

from django.db import migrations

from common.migration_kit import grant_group_permissions

VIEWER = (
    "workers.view_worker",
    "queue.view_job",
    "queue.view_jobattempt",
    "audit.view_auditevent",
)
OPERATOR = VIEWER + (
    "queue.submit_job",
    "queue.cancel_job",
    "queue.retry_job",
    "workers.drain_worker",
)
ADMIN = OPERATOR + (
    "workers.add_worker",
    "workers.change_worker",  # its labels (added with 0002, which runs this again for existing databases)
    "workers.delete_worker",
    "workers.rotate_worker_token",
    "workers.view_token",
    "workers.manage_api_tokens",
)
GROUPS = {"viewer": VIEWER, "operator": OPERATOR, "admin": ADMIN}


def create_operator_groups(apps, schema_editor):
    """Create the groups if missing and give each every permission of its list."""
    grant_group_permissions(apps, schema_editor, GROUPS, "workers", "queue", "audit")


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("workers", "0003_worker_permissions"),
        ("queue", "0005_job_permissions"),
        ("audit", "0001_initial"),
    ]

    operations = [migrations.RunPython(create_operator_groups, migrations.RunPython.noop)]
