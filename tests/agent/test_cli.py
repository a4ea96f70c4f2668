"""The agent's flags and environment: flags win, every missing or bad setting is one clear line."""

import socket
from pathlib import Path

import pytest

from worker_agent.cli import ConfigError, build_parser, resolve_config, simpletuner_main

URL = "https://orch.example.com:8001"


def config(argv, env=None):
    return resolve_config(build_parser().parse_args(argv), env or {})


def test_everything_from_the_environment():
    env = {
        "SIMPLETUNER_ORCHESTRATOR_URL": URL + "/",
        "SIMPLETUNER_WORKER_TOKEN": " wt_abc \n",
        "SIMPLETUNER_WORKER_NAME": "gpu-worker-1",
        "SIMPLETUNER_WORKER_PERSISTENT": "true",
        "SIMPLETUNER_WORKER_COMMAND": "python -m my.trainer --fast",
        "SIMPLETUNER_HEARTBEAT_INTERVAL": "10",
        "SIMPLETUNER_WORK_DIR": "/tmp/jobs-env",
    }
    c = config([], env)
    assert (c.orchestrator_url, c.token, c.name, c.persistent) == (URL, "wt_abc", "gpu-worker-1", True)
    assert c.command == "python -m my.trainer --fast"
    assert c.heartbeat_interval == 10.0
    assert c.work_dir == Path("/tmp/jobs-env")
    assert c.verify is True


def test_flags_win_over_environment():
    env = {"SIMPLETUNER_ORCHESTRATOR_URL": "http://env:1", "SIMPLETUNER_WORKER_TOKEN": "wt_env", "SIMPLETUNER_WORKER_NAME": "env"}
    c = config(["--orchestrator-url", URL, "--worker-token", "wt_flag", "--name", "flag", "--persistent", "--command", "x"], env)
    assert (c.orchestrator_url, c.token, c.name, c.persistent, c.command) == (URL, "wt_flag", "flag", True, "x")


def test_defaults_ephemeral_hostname_and_the_orchestrators_heartbeat():
    c = config(["--orchestrator-url", URL, "--worker-token", "wt_x"])
    assert c.persistent is False
    assert c.name == socket.gethostname()
    assert c.heartbeat_interval is None
    assert c.command is None


@pytest.mark.parametrize("value,expected", [("1", True), ("yes", True), ("false", False), ("0", False)])
def test_persistent_env_values(value, expected):
    c = config(["--orchestrator-url", URL, "--worker-token", "t"], {"SIMPLETUNER_WORKER_PERSISTENT": value})
    assert c.persistent is expected


@pytest.mark.parametrize(
    "argv,env,message",
    [
        ([], {"SIMPLETUNER_WORKER_TOKEN": "t"}, "no orchestrator URL"),
        (["--orchestrator-url", URL], {}, "no worker token"),
        (["--orchestrator-url", "orch:8001", "--worker-token", "t"], {}, "must be http(s)://"),
        (["--orchestrator-url", URL, "--worker-token", "t"], {"SIMPLETUNER_WORKER_PERSISTENT": "maybe"}, "true or false"),
        (["--orchestrator-url", URL, "--worker-token", "t"], {"SIMPLETUNER_HEARTBEAT_INTERVAL": "soon"}, "number of seconds"),
        (["--orchestrator-url", URL, "--worker-token", "t", "--ca-cert", "/nonexistent.pem"], {}, "no such file"),
        (["--orchestrator-url", URL, "--worker-token", "t", "--ca-cert", __file__, "--ssl-no-verify"], {}, "contradict"),
    ],
)
def test_bad_configuration_is_one_clear_error(argv, env, message):
    with pytest.raises(ConfigError) as caught:
        config(argv, env)
    assert message in str(caught.value)


def test_tls_options():
    assert config(["--orchestrator-url", URL, "--worker-token", "t", "--ssl-no-verify"]).verify is False
    assert config(["--orchestrator-url", URL, "--worker-token", "t", "--ca-cert", __file__]).verify == __file__


def test_agent_only_simpletuner_has_just_the_worker_command(capsys):
    with pytest.raises(SystemExit):
        simpletuner_main(["server"])
    assert "invalid choice" in capsys.readouterr().err
    assert simpletuner_main(["worker", "--worker-token", "t"]) == 2
    assert "no orchestrator URL" in capsys.readouterr().err


# --- --gpus and --advertise-address (several jobs per worker, multi-node jobs) -------------------------


def test_gpus_and_advertise_address_from_flags_and_environment():
    base = ["--orchestrator-url", URL, "--worker-token", "t"]
    env = {"SIMPLETUNER_WORKER_GPUS": "0, 1,2,3", "SIMPLETUNER_WORKER_ADDRESS": " 10.0.0.7 "}
    c = config(base, env)
    assert c.gpus == [0, 1, 2, 3] and c.advertise_address == "10.0.0.7"
    c = config([*base, "--gpus", "3,1", "--advertise-address", "node-b.lan"], env)
    assert c.gpus == [3, 1] and c.advertise_address == "node-b.lan"
    c = config(base)
    assert c.gpus is None and c.advertise_address is None  # every GPU NVML sees; the address the orchestrator sees
    assert config(base, {"SIMPLETUNER_WORKER_GPUS": ""}).gpus is None


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["--gpus", "0,a"], {}, "--gpus must be a comma-separated list of GPU indices"),
        (["--gpus", "-1"], {}, "--gpus must be a comma-separated list"),
        (["--gpus", "0,,1"], {}, "--gpus must be a comma-separated list"),
        (["--gpus", "1.5"], {}, "--gpus must be a comma-separated list"),
        (["--gpus", "0,1,0"], {}, "names GPU 0 twice"),
        (["--gpus", " "], {}, "--gpus is empty"),
        ([], {"SIMPLETUNER_WORKER_GPUS": "all"}, "SIMPLETUNER_WORKER_GPUS must be a comma-separated list"),
    ],
)
def test_bad_gpus_is_one_clear_error(argv, env, message):
    with pytest.raises(ConfigError) as caught:
        config(["--orchestrator-url", URL, "--worker-token", "t", *argv], env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_bad_gpus_exits_2_with_one_line(capsys):
    assert simpletuner_main(["worker", "--orchestrator-url", URL, "--worker-token", "t", "--gpus", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpus must be a comma-separated list" in err
