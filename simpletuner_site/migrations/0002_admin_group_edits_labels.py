"""Give the ``admin`` group ``workers.change_worker`` (editing workers' labels) in databases made before it:
the groups migration is idempotent, so running it again adds just what its lists gained."""

import importlib

from django.db import migrations

GROUPS = importlib.import_module("simpletuner_site.migrations.0001_operator_groups")


class Migration(migrations.Migration):
    dependencies = [("simpletuner_site", "0001_operator_groups")]

    operations = [migrations.RunPython(GROUPS.create_operator_groups, migrations.RunPython.noop)]
