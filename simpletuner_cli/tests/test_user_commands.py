"""The user commands without a server: arguments, credentials, rendering, the feed's parsing and the follow loop."""

import io
import json
import os
import stat
import sys

import pytest
import requests

from simpletuner_cli import client as client_module
from simpletuner_cli import follow, render
from simpletuner_cli.client import Credentials, api_error, load_credentials, parse_sse, save_credentials
from simpletuner_cli.download import local_path
from simpletuner_cli.errors import CLIError
from simpletuner_cli.follow import JobWatch, names_job, until_done
from simpletuner_cli.jobs import split_version
from simpletuner_cli.main import main

TOKEN = "sta_secret-token-value"


# --- arguments and help ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["jobs", "list", "--help"], ["jobs", "watch", "--help"], ["login", "--help"], ["configs", "push", "--help"], ["workers", "list", "--help"]],
)
def test_each_commands_help_names_its_environment(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "SIMPLETUNER_URL" in out and "SIMPLETUNER_TOKEN" in out and "XDG_CONFIG_HOME" in out


def test_watch_help_states_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        main(["jobs", "watch", "--help"])
    assert "0 the job completed, 1 it failed, 2 it was cancelled, 3 an error of this tool" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["jobs", "submit", "--label", "novalue"], ["jobs", "list", "--limit", "0"], ["jobs"], ["login"], ["jobs", "watch"]]
)
def test_a_bad_argument_is_a_tool_error_not_a_jobs_end(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 3
    assert "error:" in capsys.readouterr().err


def test_not_logged_in_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("SIMPLETUNER_URL", raising=False)
    monkeypatch.delenv("SIMPLETUNER_TOKEN", raising=False)
    assert main(["jobs", "list"]) == 3
    assert "not logged in: run simpletuner login --url" in capsys.readouterr().err


def test_submit_needs_a_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SIMPLETUNER_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("SIMPLETUNER_TOKEN", TOKEN)
    assert main(["jobs", "submit"]) == 3
    assert "name a stored config" in capsys.readouterr().err


def test_versions_are_numbers():
    assert split_version("sdxl@3") == ("sdxl", 3)
    assert split_version("sdxl") == ("sdxl", None)
    with pytest.raises(CLIError):
        split_version("sdxl@latest")


# --- credentials ---------------------------------------------------------------------------------------------


def test_credentials_are_private_under_xdg_config_home_and_the_environment_overrides_them(tmp_path):
    environ = {"XDG_CONFIG_HOME": str(tmp_path)}
    path = save_credentials(Credentials(url="http://a:1", token=TOKEN), client_module.credentials_path(environ))
    assert path == tmp_path / "simpletuner" / "credentials"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials(environ) == Credentials(url="http://a:1", token=TOKEN)
    overridden = load_credentials({**environ, "SIMPLETUNER_URL": "https://b/", "SIMPLETUNER_TOKEN": "sta_other"})
    assert overridden == Credentials(url="https://b", token="sta_other")
    assert TOKEN not in repr(load_credentials(environ))


def test_a_missing_or_broken_credentials_file_says_to_log_in(tmp_path):
    with pytest.raises(CLIError, match="not logged in: run simpletuner login --url URL"):
        load_credentials({"XDG_CONFIG_HOME": str(tmp_path)})
    (tmp_path / "simpletuner").mkdir()
    (tmp_path / "simpletuner" / "credentials").write_text("{not json")
    with pytest.raises(CLIError, match="run simpletuner login"):
        load_credentials({"XDG_CONFIG_HOME": str(tmp_path)})
    with pytest.raises(CLIError, match="not a server URL"):
        load_credentials({"SIMPLETUNER_URL": "localhost:8001", "SIMPLETUNER_TOKEN": TOKEN, "XDG_CONFIG_HOME": str(tmp_path)})


def _response(status, body=None, headers=None):
    response = requests.Response()
    response.status_code = status
    response._content = json.dumps(body or {}).encode()
    response.headers.update(headers or {})
    return response


def test_api_errors_say_what_to_do():
    assert "401: the token was revoked or expired" in str(api_error(_response(401, {"code": "not_authenticated"}), "x"))
    refused = api_error(_response(403, {"code": "permission_denied", "detail": "You need queue.submit_job"}), "submit")
    assert "You need queue.submit_job" in str(refused) and refused.status == 3
    invalid = api_error(_response(400, {"code": "invalid", "detail": "Invalid input.", "errors": {"gpu_count": ["too big"]}}), "x")
    assert "gpu_count: too big" in str(invalid)
    assert "retry in 7 s" in str(api_error(_response(429, {"detail": "slow down"}, {"Retry-After": "7"}), "x"))


# --- rendering ------------------------------------------------------------------------------------------------------


JOB = {
    "id": "j_0123456789abcdef", "status": "running", "config_name": "a-rather-long-config-name-for-sdxl",
    "config_version": 3, "worker_name": "gpu-node-1", "submitted_at": "2026-11-28T09:00:00Z", "submitted_by": "ada",
    "waiting_reason": None, "progress": {"step": 120, "total_steps": 500, "loss": 0.031},
}  # fmt: skip


@pytest.mark.parametrize("width", [40, 60, 80, 200])
def test_the_jobs_table_fits_the_terminal_and_keeps_the_id_whole(width):
    text = render.table([JOB, {**JOB, "status": "queued", "waiting_reason": "no worker has >= 8 GPUs"}], render.JOB_COLUMNS, width=width)
    assert all(len(line) <= width for line in text.splitlines()), text
    assert JOB["id"] in text


def test_a_job_shows_its_team_and_its_place_in_the_queue_and_submit_names_a_team():
    from simpletuner_cli.jobs import submit_body
    from simpletuner_cli.main import build_parser

    queued = {**JOB, "status": "queued", "team": "nlp", "queue_position": 3, "waiting_reason": "team nlp is at its limit"}
    details = "\n".join(render.job_details(queued))
    assert "by ada for team nlp" in details and "Place      3 in the queue" in details
    header, row = render.table([queued], render.JOB_COLUMNS, width=400).splitlines()
    assert header.split()[-3:] == ["TEAM", "WAITING", "PLACE"] and row.split()[-1] == "3"
    assert "Place" not in "\n".join(render.job_details({**JOB, "queue_position": None}))

    args = build_parser().parse_args(["jobs", "submit", "cfg", "--team", "nlp"])
    assert submit_body(args)["team"] == "nlp"
    assert "team" not in submit_body(build_parser().parse_args(["jobs", "submit", "cfg"]))


def test_a_progress_line_and_bar():
    assert render.progress_line(JOB) == "step 120/500 loss 0.031"
    assert render.progress_line({"progress": {"fraction": 0.5}}) == "50%"
    bar = render.progress_bar(JOB, eta=65, width=80)
    assert "120/500" in bar and "24%" in bar and "loss 0.031" in bar and "ETA 1m05s" in bar and len(bar) < 80
    estimator = render.EtaEstimator()
    assert estimator.eta(100, 500, now=10.0) is None
    assert estimator.eta(200, 500, now=20.0) == pytest.approx(30.0)


def test_an_artifact_key_never_leaves_the_destination(tmp_path):
    assert local_path(tmp_path, "output/checkpoint-10/model.bin") == tmp_path / "output" / "checkpoint-10" / "model.bin"
    for key in ("../escape", "/etc/passwd", "a/../../b", "a//b", "a\\b"):
        with pytest.raises(CLIError):
            local_path(tmp_path, key)


# --- the change feed and following a job -------------------------------------------------------------------------


def test_server_sent_events_are_parsed_across_chunks():
    stream = [b":" + b" " * 10 + b"\n\nevent: stream-open\ndata:\n\n", b"event: changes\ndata: {\"many\"", b": false, \"targets\": []}\n\n", b"event: keep-alive\r\ndata:\r\n\r\n"]
    assert list(parse_sse(stream)) == [("stream-open", None), ("changes", {"many": False, "targets": []}), ("keep-alive", None)]


def test_a_change_names_a_job_or_many():
    assert names_job({"many": False, "targets": [{"type": "job", "id": "j_1"}]}, "j_1")
    assert not names_job({"many": False, "targets": [{"type": "worker", "id": "j_1"}, {"type": "job", "id": "j_2"}]}, "j_1")
    assert names_job({"many": True, "targets": []}, "j_1")


class FakeFeed:
    def __init__(self, events):
        self.events = events

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        for event in self.events:
            if isinstance(event, Exception):
                raise event
            yield event


class FakeClient:
    """Answers job reads from a list of states (the last repeats), and feeds from a list of event lists."""

    url = "http://orchestrator"

    def __init__(self, states, feeds):
        self.states, self.feeds, self.reads, self.opened = list(states), list(feeds), 0, 0

    def job(self, job_id):
        self.reads += 1
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def open_feed(self):
        self.opened += 1
        feed = self.feeds.pop(0)
        if isinstance(feed, Exception):
            raise feed
        return FakeFeed(feed)


def job(status, step=None, **extra):
    return {"id": "j_1", "status": status, "worker_name": "gpu-1", "progress": {"step": step, "total_steps": 10} if step else {}, **extra}


class NoSleep:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1

    def reset(self):
        pass


def test_an_end_between_the_first_read_and_the_feed_opening_is_read_when_it_opens():
    # Read 1 (before the feed) says running; the job completes before the feed opens and no change is ever announced.
    fake = FakeClient([job("running", 3), job("completed", 10)], [[("stream-open", None)]])
    out = io.StringIO()
    assert JobWatch(fake, "j_1", out=out, tty=False).run() == 0
    assert out.getvalue().splitlines() == ["running on gpu-1", "step 3/10", "step 10/10", "completed"]


@pytest.mark.parametrize("status, code", [("completed", 0), ("failed", 1), ("cancelled", 2)])
def test_watch_exits_with_the_jobs_end(status, code):
    events = [("stream-open", None), ("changes", {"many": False, "targets": [{"type": "worker", "id": "w"}]}), ("changes", {"many": False, "targets": [{"type": "job", "id": "j_1"}]})]
    fake = FakeClient([job("queued", waiting_reason="no worker"), job("running", 5), job(status, 7, last_error="boom")], [events])
    out = io.StringIO()
    assert JobWatch(fake, "j_1", out=out, tty=False).run() == code
    assert fake.reads == 3  # the first read, the opening and the change naming the job; not the worker's
    lines = out.getvalue().splitlines()
    assert lines[0] == "queued: no worker" and lines[-1].startswith(status)


def test_a_cut_feed_is_reopened_and_read_again():
    feeds = [[("stream-open", None), requests.exceptions.ChunkedEncodingError("cut")], client_module.Unreachable("down"), [("stream-open", None)]]
    fake = FakeClient([job("running", 1), job("completed", 10)], feeds)
    backoff = NoSleep()
    reads = []
    until_done(fake, "j_1", lambda: reads.append(fake.job("j_1")["status"]) or reads[-1] == "completed", backoff=backoff)
    assert (fake.opened, backoff.waits, reads[-1]) == (3, 2, "completed")


def test_a_server_gone_for_good_ends_the_watch_with_a_tool_error(monkeypatch):
    monkeypatch.setattr(follow, "RECONNECT_FOR_S", 5)
    times = iter(range(0, 100, 3))
    fake = FakeClient([job("running", 1)], [client_module.Unreachable("the server at http://orchestrator is unreachable")] * 10)
    with pytest.raises(CLIError) as failed:
        until_done(fake, "j_1", lambda: False, clock=lambda: next(times), backoff=NoSleep())
    assert failed.value.status == 3 and "http://orchestrator is unreachable" in str(failed.value)


def test_a_terminal_shows_a_bar_redrawn_in_place():
    fake = FakeClient([job("running", 2), job("running", 5), job("completed", 10)], [[("stream-open", None), ("keep-alive", None)]])
    out = io.StringIO()
    assert JobWatch(fake, "j_1", out=out, tty=True, clock=iter(range(100)).__next__).run() == 0
    text = out.getvalue()
    assert "\r\x1b[2K[" in text and "5/10" in text
    assert text.endswith("\r\x1b[2Kstep 10/10\ncompleted\n")  # the bar gives way to the end, said in plain lines


def test_a_state_change_on_a_terminal_is_written_above_the_bar():
    out = io.StringIO()
    watch = JobWatch(FakeClient([job("running", 2)], []), "j_1", out=out, tty=True, clock=iter(range(100)).__next__)
    watch.show(job("running", 2))
    watch.show({**job("dispatched", 2), "status": "dispatched"})
    assert out.getvalue().endswith("\r\x1b[2Kdispatched on gpu-1\n" + watch.bar_text)


def test_login_reads_the_token_from_stdin_and_never_prints_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.StringIO(TOKEN + "\n"))
    seen = {}

    def answer(self, method, url, **kwargs):
        seen["authorization"] = self.headers["Authorization"]
        return _response(200, {"results": []})

    monkeypatch.setattr(requests.Session, "request", answer)
    assert main(["login", "--url", "http://orchestrator:8001/"]) == 0
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err
    assert seen["authorization"] == f"Bearer {TOKEN}"
    stored = json.loads((tmp_path / "simpletuner" / "credentials").read_text())
    assert stored == {"url": "http://orchestrator:8001", "token": TOKEN}


class FakeLogClient(FakeClient):
    """A FakeClient whose log reads answer from ``logs``: attempt number -> (text so far, outcome, stopping)."""

    def __init__(self, states, feeds, logs):
        super().__init__(states, feeds)
        self.logs = logs

    def get_json(self, path, params=None):
        text, outcome, stopping = self.logs[params["attempt"]]()
        offset = params["offset"]
        return {"attempts": max(self.logs), "attempt": params["attempt"], "outcome": outcome, "offset": offset,
                "next_offset": len(text), "skipped": 0, "text": text[offset:], "stopping": stopping}  # fmt: skip


def test_logs_follow_prints_each_attempt_once_and_waits_for_a_cancelled_jobs_last_lines():
    # Each read of attempt 2 sees more of it: running; cancelled, its worker still stopping it; stopped, last line in.
    second = iter([("b1\n", None, False), ("b1\nb2\n", "cancelled", True), ("b1\nb2\nlast\n", "cancelled", False)])
    logs = {1: lambda: ("a1\na2\n", "failed", False), 2: lambda: next(second)}
    attempts = [{"number": 1, "worker_name": "gpu-1"}, {"number": 2, "worker_name": "gpu-2"}]
    states = [{"status": status, "attempt_count": 2, "attempts": attempts} for status in ("running", "cancelled")]
    fake = FakeLogClient(states, [[("stream-open", None), ("keep-alive", None)]], logs)
    out = io.StringIO()
    assert follow.LogFollower(fake, "j_1", out=out).run() == 2
    assert out.getvalue() == "# --- attempt 1 on gpu-1 ---\na1\na2\n# --- attempt 2 on gpu-2 ---\nb1\nb2\nlast\n"


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    import subprocess

    script = (
        "import sys\n"
        "from simpletuner_cli import jobs, main\n"
        "jobs.run_configs_list = lambda args: [print('line', n) for n in range(200000)] and 0\n"
        "sys.exit(main.main(['configs', 'list']))\n"
    )
    command = f"{sys.executable} -c \"$SCRIPT\" | head -n 1; echo \"status ${{PIPESTATUS[0]}}\""
    result = subprocess.run(["bash", "-c", command], env={**os.environ, "SCRIPT": script}, capture_output=True, text=True, timeout=60)
    assert result.stdout == "line 0\nstatus 0\n" and "Traceback" not in result.stderr and "Broken" not in result.stderr, result


def test_on_a_terminal_the_token_is_asked_for_without_echo(monkeypatch):
    from simpletuner_cli import jobs

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    asked = []
    monkeypatch.setattr(jobs.getpass, "getpass", lambda prompt: asked.append(prompt) or f"  {TOKEN}  ")
    assert jobs.read_token(Terminal("typed where it would echo\n")) == TOKEN
    assert asked == ["API token (not shown): "]
    with pytest.raises(CLIError, match="no token given"):
        jobs.read_token(io.StringIO("\n"))


def test_a_multi_node_job_shows_its_members_and_submit_asks_for_nodes():
    from simpletuner_cli.jobs import submit_body
    from simpletuner_cli.main import build_parser

    members = [
        {"rank": 0, "worker_name": "gpu-a", "outcome": "", "acknowledged": True},
        {"rank": 1, "worker_name": "gpu-b", "outcome": "", "acknowledged": False},
    ]
    details = "\n".join(render.job_details({**JOB, "num_nodes": 2, "master_port": 29512, "members": members}))
    assert "Nodes      2  port 29512" in details
    assert "Rank 0     gpu-a  running" in details and "Rank 1     gpu-b  running (not acknowledged)" in details
    assert "Nodes" not in "\n".join(render.job_details(JOB))
    assert submit_body(build_parser().parse_args(["jobs", "submit", "cfg", "--nodes", "2"]))["num_nodes"] == 2
    assert "num_nodes" not in submit_body(build_parser().parse_args(["jobs", "submit", "cfg"]))
