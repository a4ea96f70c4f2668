"""The wire contract's strings are pinned: the upstream SimpleTuner agent sends and reads these exact names."""

import subprocess
import sys
from pathlib import Path

from worker_agent import protocol

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_http_names_are_the_upstream_ones():
    assert protocol.WORKER_TOKEN_HEADER == "X-Worker-Token"
    assert [protocol.REGISTER_PATH, protocol.HEARTBEAT_PATH, protocol.STREAM_PATH, protocol.QUEUE_PATH] == [
        "/api/workers/register",
        "/api/workers/heartbeat",
        "/api/workers/stream",
        "/api/workers/queue",
    ]
    assert protocol.DISCONNECT_PATH == "/api/workers/disconnect"
    assert protocol.job_status_path("j_42") == "/api/workers/job/j_42/status"


def test_event_types_statuses_and_codes_are_the_wire_values():
    events = [protocol.JOB_SUBMIT, protocol.JOB_CANCEL, protocol.DRAIN, protocol.SHUTDOWN, protocol.PING]
    assert events == ["job_submit", "job_cancel", "drain", "shutdown", "ping"]
    assert [protocol.STREAM_RESET, protocol.KEEP_ALIVE, protocol.STREAM_OPEN] == ["stream-reset", "keep-alive", "stream-open"]
    assert protocol.REPORTED_STATUSES == ("starting", "training", "running", "completed", "failed", "cancelled")
    assert [protocol.AGENT_IDLE, protocol.AGENT_BUSY] == ["idle", "busy"]
    assert [protocol.TOKEN_REVOKED, protocol.WORKER_DELETED] == ["token_revoked", "worker_deleted"]
    assert [protocol.WORKER_PERSISTENT, protocol.WORKER_EPHEMERAL, protocol.WORKER_LOCAL] == ["persistent", "ephemeral", "local"]
    assert protocol.NOT_AUTHENTICATED == "not_authenticated"
    refusals = [protocol.JOB_NOT_OWNED, protocol.STALE_ATTEMPT, protocol.JOB_CANCELLED]
    assert refusals == ["job_not_owned", "stale_attempt", "job_cancelled"]


def test_protocol_imports_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import worker_agent.protocol; "
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['worker_agent']"


def test_minimal_report_keeps_what_ends_the_job_and_nothing_a_server_could_refuse():
    report = {
        "status": protocol.FAILED,
        "attempt": "a_1",
        "exit_code": 0xC0000005,
        "error": "Training exited: \x00\x1b[31mboom\udcff\n" + "x" * 1000,
        "progress": {"loss": float("nan")},
        "log_tail": "\x00" * 100,
        "journal": True,
    }

    minimal = protocol.minimal_report(report)

    assert set(minimal) == {"status", "attempt", "exit_code", "error", "journal"}
    assert minimal["error"].startswith("Training exited: \ufffd\ufffd[31mboom\ufffd x")
    assert len(minimal["error"]) == protocol.MINIMAL_ERROR_MAX_CHARS
    assert all(c.isprintable() for c in minimal["error"])


def test_minimal_report_leaves_out_an_exit_code_out_of_range():
    for code in (2**32, -(2**31) - 1, 10**30, True, 3.5, "3"):
        assert "exit_code" not in protocol.minimal_report({"status": "failed", "attempt": "a", "exit_code": code})
    assert protocol.minimal_report({"status": "completed", "attempt": None, "exit_code": 0}) == {
        "status": "completed",
        "attempt": None,
        "exit_code": 0,
    }
    assert protocol.RESULT_STATUSES == {"completed", "failed", "cancelled"}
    assert (protocol.EXIT_CODE_MIN, protocol.EXIT_CODE_MAX) == (-(2**31), 2**32 - 1)


def test_what_a_trainer_is_given_uses_torchruns_and_simpletuners_names():
    assert protocol.VISIBLE_DEVICES_ENV == "CUDA_VISIBLE_DEVICES"
    assert protocol.GANG_ENV == {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT", "node_rank": "NODE_RANK", "num_nodes": "NNODES"}
    assert [protocol.VISIBLE_DEVICES_CONFIG_KEY, protocol.NUM_PROCESSES_CONFIG_KEY, protocol.SAME_NETWORK_CONFIG_KEY] == [
        "accelerate_visible_devices",
        "num_processes",
        "same_network",
    ]
    assert protocol.GANG_CONFIG_KEYS == {
        "num_nodes": "num_machines",
        "node_rank": "machine_rank",
        "master_addr": "main_process_ip",
        "master_port": "main_process_port",
    }
