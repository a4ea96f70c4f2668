"""PostgreSQL statements prepared on the server (SIMPLETUNER_DB_PREPARE_THRESHOLD), or not at all."""

import json
import os
import subprocess
import sys

import pytest
from django.db import connection, transaction

from job_queue.models import Job

SERVER = "postgres://postgres@127.0.0.1:5432/any"  # settings only parse it: nothing connects


def _options(tmp_path, **env):
    code = "import json, simpletuner_site.settings as s; print(json.dumps(s.DATABASES['default'].get('OPTIONS', {}), default=str))"
    environ = {**os.environ, "SIMPLETUNER_DATA_DIR": str(tmp_path), **env}
    result = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    return result


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [(None, {"server_side_binding": True, "prepare_threshold": 2}), ("5", {"server_side_binding": True, "prepare_threshold": 5}), ("0", {})],
)  # fmt: skip
def test_postgresql_binds_on_the_server_and_prepares_unless_told_not_to(tmp_path, threshold, expected):
    env = {"DATABASE_URL": SERVER} if threshold is None else {"DATABASE_URL": SERVER, "SIMPLETUNER_DB_PREPARE_THRESHOLD": threshold}
    result = _options(tmp_path, **env)
    assert result.returncode == 0, result.stderr
    options = json.loads(result.stdout)
    assert {k: options[k] for k in ("server_side_binding", "prepare_threshold") if k in options} == expected


def test_sqlite_has_nothing_to_prepare(tmp_path):
    result = _options(tmp_path, DATABASE_URL="", SIMPLETUNER_DB_PREPARE_THRESHOLD="3")
    assert result.returncode == 0, result.stderr
    assert "prepare_threshold" not in json.loads(result.stdout)


def test_a_bad_threshold_stops_start_up(tmp_path):
    result = _options(tmp_path, DATABASE_URL=SERVER, SIMPLETUNER_DB_PREPARE_THRESHOLD="-1")
    assert result.returncode != 0
    assert "ImproperlyConfigured: SIMPLETUNER_DB_PREPARE_THRESHOLD must be >= 0" in result.stderr


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_statement_run_again_on_a_connection_is_prepared_there(postgres_url, settings):
    assert connection.vendor == "postgresql"  # the test database follows DATABASE_URL
    threshold = settings.DATABASES["default"]["OPTIONS"].get("prepare_threshold")
    assert threshold == 2  # the test run's own settings: the default
    with transaction.atomic():
        for _ in range(threshold + 1):
            list(Job.objects.filter(config_name="prepared-probe").values_list("pk", flat=True))
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement FROM pg_prepared_statements")
            prepared = [row[0] for row in cursor.fetchall()]
    assert any("prepared-probe" not in text and '"queue_job"."config_name" = $1' in text for text in prepared), prepared


def _request_threads(tmp_path, **env):
    code = "import simpletuner_site.settings as s; print(s.REQUEST_THREADS)"
    environ = {k: v for k, v in os.environ.items() if k not in ("SIMPLETUNER_REQUEST_THREADS", "SIMPLETUNER_DB_POOL_SIZE")}
    environ.update(SIMPLETUNER_DATA_DIR=str(tmp_path), **env)
    result = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.parametrize(
    ("env", "threads"),
    [
        ({"DATABASE_URL": ""}, 4),  # SQLite: one writer at a time
        ({"DATABASE_URL": SERVER}, 8),  # PostgreSQL: a few beside the one thread of Python running, not the pool's 20
        ({"DATABASE_URL": SERVER, "SIMPLETUNER_DB_POOL_SIZE": "5"}, 5),  # no more than the pool lends
        ({"DATABASE_URL": SERVER, "SIMPLETUNER_DB_POOL_SIZE": "0"}, 8),  # no pool: a connection per request
        ({"DATABASE_URL": SERVER, "SIMPLETUNER_REQUEST_THREADS": "32"}, 32),
    ],
    ids=["sqlite", "postgresql", "small-pool", "no-pool", "set"],
)
def test_request_threads_default_to_a_few_per_process(tmp_path, env, threads):
    assert _request_threads(tmp_path, **env) == threads
