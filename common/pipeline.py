"""Several statements sent to the database together: on PostgreSQL, in psycopg's pipeline mode."""

from django.db import connection


def first_rows(statements):
    """Run each ``(sql, params)`` of ``statements``, in order, on the default connection; return the first row
    each one returned (None for one that returned none).

    On PostgreSQL they are sent in one pipeline (psycopg's pipeline mode): the server runs each as it
    arrives while the next are still being sent, and the answers come back together, so the statements
    wait for about one round trip instead of one each. Run them in a transaction: an error aborts the
    statements after it, and is raised (as Django's ``DatabaseError``) when the pipeline ends. Elsewhere
    (SQLite, in process) they simply run one after the other.
    """
    if connection.vendor != "postgresql" or len(statements) < 2:
        rows = []
        for sql, params in statements:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                rows.append(cursor.fetchone() if cursor.description is not None else None)
        return rows
    connection.ensure_connection()
    cursors = []
    try:
        with connection.wrap_database_errors, connection.connection.pipeline():
            for sql, params in statements:
                cursor = connection.cursor()
                cursors.append(cursor)
                cursor.execute(sql, params)
        return [cursor.fetchone() if cursor.description is not None else None for cursor in cursors]
    finally:
        for cursor in cursors:
            cursor.close()
