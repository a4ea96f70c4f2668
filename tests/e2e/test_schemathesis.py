"""Schemathesis against our own OpenAPI schema, on a real server: 0 server errors, 0 responses that
contradict the schema, 0 requests the schema allows but the server refuses (and the reverse).

Two bounded runs per database (a fixed seed, so a failure replays; ``SCHEMATHESIS_SEED`` and
``SCHEMATHESIS_MAX_EXAMPLES`` change them): the worker protocol with a worker's token, then every
operator route with an operator's token, stateful phase included (it follows the schema's links:
create a worker, rotate its token, delete it...). The SSE stream is left out: a request the schema
allows never ends. Its 405 and its Last-Event-ID refusal are tested in ``workers/tests``.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import expect, own_orchestrator

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("SCHEMATHESIS_SEED", "20261124"))
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "15"))
ST = Path(sys.executable).with_name("st")

# OpenAPI-aware authentication: each operation gets the credential its `security` names.
CONFIG = """\
[auth.openapi.operatorToken]
bearer = "${ST_OPERATOR_TOKEN}"

[auth.openapi.workerToken]
api_key = "${ST_WORKER_TOKEN}"

# Status reports go to a job dispatched to that worker, so they reach the report logic, not a 404.
[[operations]]
include-operation-id = "workers_job_status_create"
parameters = { job_id = "${ST_JOB_ID}" }

# Refusals no schema can say, each a 400 naming its field and tested where it is made: a webhook URL must be
# http(s) and resolve to a public address (webhooks/tests/test_services.py); a usage window must not end
# before it starts (observability/tests/test_usage.py). Data the schema allows may meet them; any other answer is still checked.
[[operations]]
include-operation-id = ["admin_webhooks_create", "admin_webhooks_partial_update", "usage_retrieve"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429"]
"""

RUNS = {
    "worker protocol": [
        "--include-path-regex", "^/api/workers/", "--exclude-operation-id", "workers_stream",
        "--phases", "examples,coverage,fuzzing",
    ],
    "operator routes": ["--exclude-path-regex", "^/api/workers/"],
}  # fmt: skip


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ]
)
def fuzz_server(request, tmp_path):
    """A server of its own (the runs create and delete what they like), failed-auth throttling out of the way."""
    # ignored_auth sends bad tokens on purpose: at the default rate they would soon be 429s.
    yield from own_orchestrator(request, tmp_path / "orchestrator", extra_env={"SIMPLETUNER_FAILED_AUTH_RATE": "1000000/min"})


def test_schemathesis_finds_no_server_error_and_no_schema_disagreement(fuzz_server, tmp_path):
    schema = expect(fuzz_server.admin("GET", "/api/schema/", params={"format": "json"}), 200)
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    worker = expect(fuzz_server.admin("POST", "/api/admin/workers", json={"name": "schemathesis"}), 201)
    expect(fuzz_server.as_worker(worker["token"], "POST", "/api/workers/register", json={"gpu_count": 1}), 200)
    stream = fuzz_server.stream(worker["token"])
    try:
        job = expect(fuzz_server.admin("POST", "/api/queue/submit", json={"config_name": "fuzz"}), 201)
        dispatched = stream.wait_for("job_submit").json()
        assert dispatched["job_id"] == job["id"], dispatched
    finally:
        stream.close()
    env = {
        **os.environ,
        "ST_OPERATOR_TOKEN": fuzz_server.admin_token,
        "ST_WORKER_TOKEN": worker["token"],
        "ST_JOB_ID": job["id"],
    }

    cases = {}
    for name, selection in RUNS.items():
        result = subprocess.run(
            [
                str(ST), "--no-color", "run", "schema.json", "--url", fuzz_server.base_url,
                "--checks", "all", "--seed", str(SEED), "--max-examples", str(MAX_EXAMPLES),
                "--request-timeout", "10", *selection,
            ],  # fmt: skip
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = result.stdout + result.stderr
        summary = re.search(r"(\d+) generated", output)
        failures = output[output.find("=== FAILURES ===") :] if "=== FAILURES ===" in output else output
        assert result.returncode == 0 and summary, (
            f"schemathesis ({name}) exited {result.returncode}:\n{failures[:30000]}\n"
            f"--- server log ---\n{fuzz_server.read_log()[-3000:]}"
        )
        cases[name] = int(summary.group(1))
    print(f"schemathesis, {fuzz_server.backend}, seed {SEED}: " + ", ".join(f"{n}: {c} cases" for n, c in cases.items()))
    assert all(cases.values()), cases
