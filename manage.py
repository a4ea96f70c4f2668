#!/usr/bin/env python
"""Django's command-line utility for administrative tasks, in the orchestrator's environment.

It reads the environment file named by SIMPLETUNER_ENV_FILE first (the same file as the servers and Celery), reports
a bad setting in one line, connects to PostgreSQL without a pool (one thread: a database that cannot be reached fails
at once, with the driver's reason), and says on stderr, after a command that succeeded or failed with a traceback, which
database it used when that was the embedded SQLite because DATABASE_URL is not set.
"""
import os
import sys
import traceback


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "simpletuner_site.settings")
    from django.core.exceptions import ImproperlyConfigured

    try:
        from simpletuner_site.env import load_env_file

        load_env_file()
        from django.conf import settings

        database = settings.DATABASES["default"]
    except ImproperlyConfigured as exc:
        sys.exit(f"manage.py: error: configuration: {exc}")
    # psycopg's pool waits its whole timeout (30 s) for a connection it cannot make and drops the reason.
    database.get("OPTIONS", {}).pop("pool", None)
    used = []
    if not getattr(settings, "DATABASE_URL", "") and database["ENGINE"].endswith("sqlite3"):
        from django.db.backends.signals import connection_created

        connection_created.connect(lambda **kwargs: used.append(True), weak=False)
    from django.core.management import execute_from_command_line

    def say_which_database():
        if used:
            print(
                f"manage.py: used the embedded SQLite database {database['NAME']} (DATABASE_URL is not set; "
                "SIMPLETUNER_ENV_FILE=/etc/simpletuner/orchestrator.env reads a production one)",
                file=sys.stderr,
            )

    try:
        execute_from_command_line(sys.argv)  # a CommandError exits here, with its one line on stderr
    except Exception:  # e.g. "no such table: auth_user" in an SQLite database nobody migrated: the database is news
        traceback.print_exc()
        say_which_database()
        sys.exit(1)
    say_which_database()

if __name__ == "__main__":
    main()
