"""One permission per operator action on workers, in place of workers.manage_workers.

Whoever held manage_workers (a user or a group) is given each permission it stood for, then it goes.
"""

from django.db import migrations

from common.migration_kit import create_app_permissions, permissions_by_name

# What workers.manage_workers allowed: read, create, drain, rotate tokens, delete.
MANAGE_WORKERS_BECAME = (
    "workers.view_worker",
    "workers.add_worker",
    "workers.drain_worker",
    "workers.rotate_worker_token",
    "workers.delete_worker",
)


def split_manage_workers(apps, schema_editor):
    Permission = apps.get_model("auth", "Permission")
    old = Permission.objects.filter(content_type__app_label="workers", codename="manage_workers").first()
    if old is None:  # a new database: nobody held it
        return
    create_app_permissions(apps, schema_editor, "workers")
    new = list(permissions_by_name(apps, MANAGE_WORKERS_BECAME).values())
    for group in old.group_set.all():
        group.permissions.add(*new)
    for user in old.user_set.all():
        user.user_permissions.add(*new)
    old.delete()


class Migration(migrations.Migration):

    dependencies = [
        ('workers', '0002_server_presence'),
        ('auth', '0012_alter_user_first_name_max_length'),
        ('contenttypes', '0002_remove_content_type_name'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='token',
            options={'permissions': [('manage_api_tokens', "Can manage operators' API tokens (revoke them)")]},
        ),
        migrations.AlterModelOptions(
            name='worker',
            options={'ordering': ['name'], 'permissions': [('drain_worker', 'Can drain a worker (it finishes its job and takes no new one)'), ('rotate_worker_token', "Can rotate a worker's token")]},
        ),
        migrations.RunPython(split_manage_workers, migrations.RunPython.noop),
    ]
