"""The environment the harness gives the servers it starts: the run's switches in, the rest scrubbed."""

from tests.e2e.harness import Orchestrator


def test_the_fast_paths_switch_reaches_the_servers_and_other_simpletuner_variables_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_FAST_PATHS", "off")
    monkeypatch.setenv("SIMPLETUNER_HEARTBEAT_INTERVAL", "1")
    monkeypatch.setenv("DATABASE_URL", "postgres://elsewhere/db")

    env = Orchestrator(backend="sqlite", data_dir=tmp_path, extra_env={"SIMPLETUNER_JOB_MAX_RETRIES": "2"}).env()

    assert env["SIMPLETUNER_FAST_PATHS"] == "off"
    assert env["SIMPLETUNER_JOB_MAX_RETRIES"] == "2"
    assert "SIMPLETUNER_HEARTBEAT_INTERVAL" not in env
    assert "DATABASE_URL" not in env
    assert env["SIMPLETUNER_DATA_DIR"] == str(tmp_path)
