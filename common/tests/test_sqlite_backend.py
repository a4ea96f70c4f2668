"""common.db.sqlite3: the transactions of one process queue on a lock, and the next starts when the last ends."""

import threading
import time

import pytest
from django.db import OperationalError
from django.db.backends.sqlite3 import base as django_sqlite
from django.db.utils import ConnectionHandler

from common.db.sqlite3 import base

WAITER_BLOCKS_S = 0.2  # time for the other thread to go from "about to begin" to blocking in its BEGIN


def _settings(path, timeout=5):
    handler = ConnectionHandler({"default": {"ENGINE": "common.db.sqlite3", "NAME": str(path),
                                       "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": timeout}}})
    return handler.settings["default"]


def _connect(db_settings):
    db = base.DatabaseWrapper(db_settings, "x")
    db.ensure_connection()
    return db


def _begin(db):
    db.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)


def _end(db, commit=True):
    db.commit() if commit else db.rollback()
    db.set_autocommit(True)


@pytest.fixture(autouse=True)
def _own_database(django_db_blocker):
    """These tests open their own SQLite file, not the test database."""
    with django_db_blocker.unblock():
        yield


@pytest.fixture
def db_settings(tmp_path, _own_database):
    db_settings = _settings(tmp_path / "lock.sqlite3")
    db = _connect(db_settings)
    with db.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("CREATE TABLE t (v INTEGER)")
    db.close()
    return db_settings


def _in_thread(target):
    out = {}

    def run():
        try:
            out["value"] = target()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_waiting_transaction_waits_on_the_lock_not_in_sqlites_busy_handler(db_settings):
    """The waiter's SQLite busy timeout is 0: had its BEGIN reached SQLite while the first transaction held
    the write lock, SQLite would have refused it at once ("database is locked", as Django's own backend
    does here). It waits on this process's lock instead, and begins once the first has committed."""
    first = _connect(db_settings)
    _begin(first)
    about_to_begin = threading.Event()

    def then():
        db = _connect(db_settings)
        with db.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 0")
        about_to_begin.set()
        _begin(db)  # waits for ``first``
        with db.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM t")
            seen = cursor.fetchone()[0]
        _end(db)
        db.close()
        return seen

    thread, out = _in_thread(then)
    assert about_to_begin.wait(10)
    time.sleep(WAITER_BLOCKS_S)
    with first.cursor() as cursor:
        cursor.execute("INSERT INTO t VALUES (1)")
    _end(first)
    thread.join(10)

    assert out == {"value": 1}  # no error; it began after the commit, and saw it
    assert not first.holds_transaction_lock
    first.close()


def test_a_transaction_that_waits_past_the_timeout_gets_sqlites_error(db_settings):
    first = _connect(db_settings)
    _begin(first)

    def impatient():
        db = _connect({**db_settings, "OPTIONS": {**db_settings["OPTIONS"], "timeout": 0.1}})
        try:
            _begin(db)
        finally:
            assert not db.holds_transaction_lock
            db.close()

    thread, out = _in_thread(impatient)
    thread.join(10)
    assert isinstance(out.get("error"), OperationalError) and "database is locked" in str(out["error"])
    _end(first)
    first.close()


def test_a_rollback_a_failed_begin_and_a_close_each_release_the_lock(db_settings, monkeypatch):
    db = _connect(db_settings)
    _begin(db)
    _end(db, commit=False)
    assert not db.holds_transaction_lock

    def broken(self):
        raise OperationalError("disk I/O error")

    with monkeypatch.context() as patch:
        patch.setattr(django_sqlite.DatabaseWrapper, "_start_transaction_under_autocommit", broken)
        with pytest.raises(OperationalError):
            _begin(db)
    assert not db.holds_transaction_lock
    db.set_autocommit(True)

    _begin(db)
    db.close()  # with the transaction open: SQLite rolls it back
    assert not db.holds_transaction_lock

    def other():
        db = _connect(db_settings)
        _begin(db)
        _end(db)
        db.close()

    thread, out = _in_thread(other)
    thread.join(10)
    assert "error" not in out and not thread.is_alive()


def test_connections_to_one_file_share_one_lock_and_other_files_have_their_own(tmp_path):
    assert base.transaction_lock(tmp_path / "a.sqlite3") is base.transaction_lock(str(tmp_path / "a.sqlite3"))
    assert base.transaction_lock(tmp_path / "a.sqlite3") is not base.transaction_lock(tmp_path / "b.sqlite3")
