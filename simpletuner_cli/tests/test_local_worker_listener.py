"""The local worker at a server's start (issue 32.9): the agent starts before the server listens, so its
first "connection refused" is no news and is not printed once it registers; refusals that go on are."""

from simpletuner_cli import local_worker as lw

from .test_local_worker import Output, StandIn, make_worker  # noqa: F401 (make_worker: a fixture)

REFUSED = (
    "12:00:00 Cannot register: cannot reach the orchestrator at http://127.0.0.1:8001: connection refused. "
    "Fix: verify the orchestrator URL and port, ... and that the orchestrator runs with --host 0.0.0.0; retrying in 1s"
)


def _agent(*lines, then_wait=True):
    printed = "".join(f"print({line!r}, flush=True)\ntime.sleep(0.05)\n" for line in lines)
    return "import time\n" + printed + ("while True: time.sleep(0.05)\n" if then_wait else "")


def test_a_refusal_before_the_listener_is_up_is_not_printed(make_worker):
    output = Output()
    agent = _agent("12:00:00 Connecting to http://127.0.0.1:8001", REFUSED, "12:00:01 Registered as local@host (w_1)", "ready")
    make_worker(StandIn(agent), output=output).start()

    output.wait_for("ready")

    assert "[local worker] 12:00:00 Connecting to http://127.0.0.1:8001" in output
    assert "[local worker] 12:00:01 Registered as local@host (w_1)" in output
    assert not any("connection refused" in line for line in output)


def test_refusals_that_go_on_past_the_grace_are_printed(make_worker):
    output = Output()
    agent = _agent(REFUSED, REFUSED.replace("12:00:00", "12:00:02"), "still trying")
    make_worker(StandIn(agent), output=output, listener_grace=0.02).start()

    output.wait_for("still trying")

    assert [line for line in output if "connection refused" in line] == [
        lw.OUTPUT_PREFIX + REFUSED,
        lw.OUTPUT_PREFIX + REFUSED.replace("12:00:00", "12:00:02"),
    ]


def test_an_agent_that_exits_refused_leaves_its_lines(make_worker):
    output = Output()
    make_worker(StandIn(_agent(REFUSED, then_wait=False)), output=output).start()

    output.wait_for("connection refused")
