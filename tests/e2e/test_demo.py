"""`make demo` keeps working: the scripted fleet takes every job to completion where it belongs."""

import os
import subprocess
import sys

import pytest

from .harness import REPO_ROOT

pytestmark = pytest.mark.e2e


def test_demo_runs_every_job_to_completion_on_the_right_worker():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SIMPLETUNER_DATA_DIR")}
    result = subprocess.run(
        [sys.executable, "scripts/demo.py", "--steps", "20", "--step-delay", "0.02"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "every job completed on the worker its labels chose" in output
    summary = output[output.index("demo | summary:"):]
    for job, worker in (("vision-lr-0.1", "gpu-vision"), ("nlp-lr-0.3", "gpu-nlp"), ("local-smoke-test", "local@")):
        line = next(line for line in summary.splitlines() if job in line)
        assert "completed" in line and f"on {worker}" in line, line
