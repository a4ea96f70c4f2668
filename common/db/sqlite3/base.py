"""Django's SQLite backend, with the transactions of one process queued on a lock instead of SQLite's busy handler.

SQLite lets one connection write at a time, and our transactions take its write lock when they begin
(``BEGIN IMMEDIATE``). A connection that finds the lock taken sleeps in SQLite's busy handler (1, 2,
5, 10, 15, 20, 25, 25, 25, 50, 50, 100 ms, then 100 ms at a time) and tries again, so a writer
waits until its next try however soon the lock was released, and under steady load an unlucky one
loses race after race for hundreds of milliseconds.

Here a transaction of this process first takes a process-wide lock for the database file, held from
its ``BEGIN`` until its ``COMMIT`` or ``ROLLBACK``: the next transaction starts the moment the last
one ends, in turn. It mirrors the lock SQLite itself would make the transaction wait for, so it adds
no wait SQLite would not impose. A statement in autocommit mode takes no such lock (it holds SQLite's
only for the time of the statement, and a Python lock there would be held until its thread next got
the GIL); another process's writes are still waited for by SQLite's busy handler. A transaction
that cannot have the lock within the database's ``timeout`` option gets SQLite's own error
(``OperationalError: database is locked``).
"""

import threading

from django.db import OperationalError
from django.db.backends.sqlite3 import base

_LOCKS = {}
_LOCKS_GUARD = threading.Lock()


def transaction_lock(name):
    """Return the process-wide transaction lock of the SQLite database ``name`` (its NAME setting)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(str(name), threading.Lock())


class DatabaseWrapper(base.DatabaseWrapper):
    """Django's SQLite ``DatabaseWrapper``; its transactions take ``transaction_lock(NAME)`` (see the module)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.holds_transaction_lock = False
        self._transaction_lock = transaction_lock(self.settings_dict["NAME"])
        self._transaction_lock_timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 5))

    def _start_transaction_under_autocommit(self):
        if not self.holds_transaction_lock:
            if not self._transaction_lock.acquire(timeout=self._transaction_lock_timeout):
                raise OperationalError(
                    f"database is locked (another transaction of this process held it for {self._transaction_lock_timeout:g} s)"
                )
            self.holds_transaction_lock = True
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._release_transaction_lock()
            raise

    def _release_transaction_lock(self, *, closed=False):
        """Release the lock unless a transaction is still open on the connection (a COMMIT that failed);
        ``closed``: the connection was closed, which ended its transaction."""
        if self.holds_transaction_lock and (closed or self.connection is None or not self.connection.in_transaction):
            self.holds_transaction_lock = False
            self._transaction_lock.release()

    def _commit(self):
        try:
            return super()._commit()
        finally:
            self._release_transaction_lock()

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            self._release_transaction_lock()

    def _close(self):
        try:
            return super()._close()
        finally:
            self._release_transaction_lock(closed=True)
