"""Helpers for data migrations that hand out permissions."""

from django.contrib.auth.management import create_permissions


def create_app_permissions(apps, schema_editor, *app_labels):
    """Create now the permissions of ``app_labels``' models as of this migration.

    Django creates them only after the whole ``migrate`` run (post_migrate), too late for a data
    migration that grants them on a new database.
    """
    for label in app_labels:
        app_config = apps.get_app_config(label)
        models_module = getattr(app_config, "models_module", None)
        # The migration state's app configs have none, and create_permissions skips an app without one.
        app_config.models_module = models_module or True
        try:
            create_permissions(app_config, verbosity=0, using=schema_editor.connection.alias, apps=apps)
        finally:
            app_config.models_module = models_module


def permissions_by_name(apps, names):
    """Return ``{"app_label.codename": Permission}`` for ``names`` (raise LookupError naming any that is missing)."""
    Permission = apps.get_model("auth", "Permission")
    wanted = {tuple(name.split(".", 1)) for name in names}
    found = {
        f"{p.content_type.app_label}.{p.codename}": p
        for p in Permission.objects.select_related("content_type").filter(
            codename__in={codename for _, codename in wanted},
            content_type__app_label__in={label for label, _ in wanted},
        )
    }
    missing = set(names) - set(found)
    if missing:
        raise LookupError(f"permissions missing: {', '.join(sorted(missing))}")
    return found


def grant_group_permissions(apps, schema_editor, grants, *app_labels):
    """Give each group of ``grants`` (``{group name: permission names}``, created if missing) its permissions,
    first creating those of ``app_labels``. Takes nothing away: permissions added by hand stay."""
    create_app_permissions(apps, schema_editor, *app_labels)
    Group = apps.get_model("auth", "Group")
    permissions = permissions_by_name(apps, {name for names in grants.values() for name in names})
    for group_name, names in grants.items():
        group, _ = Group.objects.get_or_create(name=group_name)
        group.permissions.add(*(permissions[name] for name in names))
