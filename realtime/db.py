"""DB work for async stream views: in a pool thread, never the process-wide sync thread, connection closed after."""

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connection


def in_db_thread(fn):
    """Run ``fn`` in a pool thread (not the stream's shared sync thread) and close its DB connection after."""

    def wrapper(*args, **kwargs):
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            connection.close()

    return sync_to_async(wrapper, thread_sensitive=False)
