"""SIMPLETUNER_ENV_FILE (simpletuner_site.env.load_env_file), the banner that names it, and the start-up check of Redis."""

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.core.exceptions import ImproperlyConfigured

from simpletuner_cli import serve
from simpletuner_cli.errors import CLIError
from simpletuner_site.env import load_env_file

from .test_cli import _banner_settings


@pytest.fixture
def environ(monkeypatch):
    """A copy of the process environment for the test to change (load_env_file writes os.environ)."""
    copy = {k: v for k, v in os.environ.items() if not k.startswith("ST_TEST_")}
    copy.pop("SIMPLETUNER_ENV_FILE", None)
    monkeypatch.setattr(os, "environ", copy)
    return copy


def write(tmp_path, text):
    path = tmp_path / "orchestrator.env"
    path.write_text(text)
    return path


def test_the_file_fills_the_environment_as_systemd_would_read_it(environ, tmp_path):
    path = write(
        tmp_path,
        "# a comment\n\n"
        "ST_TEST_URL=postgres://simpletuner:p#w@127.0.0.1:5432/simpletuner\n"
        'ST_TEST_QUOTED="two words"  # a trailing comment\n'
        "export ST_TEST_EXPORTED=yes\n"
        "ST_TEST_LITERAL='$HOME/${USER}'\n"
        "ST_TEST_EMPTY=\n",
    )
    environ["SIMPLETUNER_ENV_FILE"] = str(path)

    assert load_env_file() == path
    assert environ["ST_TEST_URL"] == "postgres://simpletuner:p#w@127.0.0.1:5432/simpletuner"
    assert environ["ST_TEST_QUOTED"] == "two words"
    assert environ["ST_TEST_EXPORTED"] == "yes"
    assert environ["ST_TEST_LITERAL"] == "$HOME/${USER}"  # no expansion, like EnvironmentFile=
    assert environ["ST_TEST_EMPTY"] == ""


def test_the_process_environment_wins_over_the_file(environ, tmp_path):
    environ["SIMPLETUNER_ENV_FILE"] = str(write(tmp_path, "ST_TEST_DB=from-the-file\nST_TEST_OTHER=file\n"))
    environ["ST_TEST_DB"] = "from-the-process"

    load_env_file()

    assert (environ["ST_TEST_DB"], environ["ST_TEST_OTHER"]) == ("from-the-process", "file")


def test_no_variable_no_file(environ):
    before = dict(environ)
    assert load_env_file() is None
    assert environ == before


def test_a_missing_file_is_an_error_naming_it(environ, tmp_path):
    environ["SIMPLETUNER_ENV_FILE"] = str(tmp_path / "missing.env")

    with pytest.raises(ImproperlyConfigured) as raised:
        load_env_file()

    assert str(raised.value) == (
        f"SIMPLETUNER_ENV_FILE={tmp_path / 'missing.env'}: cannot read the environment file: No such file or directory"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ST_TEST_A=1\nnot an assignment\n", "line 2: not KEY=value: 'not an assignment'"),
        ("ST_TEST_A=1\nST_TEST_B\n", "line 2: ST_TEST_B has no value (write ST_TEST_B= for an empty one)"),
    ],
    ids=["not-an-assignment", "no-value"],
)
def test_a_bad_line_is_an_error_and_nothing_is_read(environ, tmp_path, text, message):
    path = write(tmp_path, text)
    environ["SIMPLETUNER_ENV_FILE"] = str(path)

    with pytest.raises(ImproperlyConfigured) as raised:
        load_env_file()

    assert str(raised.value) == f"{path}, {message}"
    assert "ST_TEST_A" not in environ


def test_the_banner_names_the_env_file_and_the_embedded_database():
    settings = _banner_settings()  # the embedded SQLite database, DATABASE_URL unset
    settings.ENV_FILE = Path("/etc/simpletuner/orchestrator.env")

    lines = serve.banner_lines(settings=settings, url="http://h:8001", listen="h:8001")

    assert "  Env file     /etc/simpletuner/orchestrator.env" in lines
    assert "  Database     SQLite /srv/st/db.sqlite3 (embedded: DATABASE_URL is not set)" in lines
    assert lines[-1] == (
        "  API token    SIMPLETUNER_ENV_FILE=/etc/simpletuner/orchestrator.env python manage.py create_api_token "
        "USERNAME --superuser"
    )


def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_redis_that_does_not_answer_is_a_warning_outside_production_mode(capsys):
    url = f"redis://127.0.0.1:{closed_port()}/0"

    serve.check_redis(SimpleNamespace(REDIS_URL=url, PRODUCTION=False), timeout=1)

    err = capsys.readouterr().err
    assert err.startswith(f"simpletuner server: warning: Redis {url} does not answer: ")
    assert "Connection refused" in err and "serving anyway" in err


def test_redis_that_does_not_answer_stops_a_server_in_production_mode():
    url = f"redis://:s3cret@127.0.0.1:{closed_port()}/0"

    with pytest.raises(CLIError) as raised:
        serve.check_redis(SimpleNamespace(REDIS_URL=url, PRODUCTION=True), timeout=1)

    message = str(raised.value)
    assert message.startswith(f"Redis redis://:****@127.0.0.1:{url.rsplit(':', 1)[1]} does not answer: ")
    assert "Connection refused" in message and "production mode needs it" in message
    assert "s3cret" not in message


def test_clear_metrics_dir_removes_only_the_counter_files(tmp_path, monkeypatch):
    from io import StringIO

    from django.core.management import call_command

    for name in ("counter_101.db", "histogram_102.db", "notes.txt"):
        (tmp_path / name).write_text("x")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    out = StringIO()

    call_command("clear_metrics_dir", stdout=out)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert out.getvalue() == f"Removed 2 file(s) from {tmp_path}\n"
