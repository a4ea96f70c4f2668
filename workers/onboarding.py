"""What an operator needs to bring a worker up: labels typed as KEY=VALUE, and its agent's command line.

Shared by ``manage.py create_worker`` and the admin's "Add worker" page.
"""

import shlex

from common.errors import InvalidInput

from .models import WorkerType

# What an operator may create; `local` is the orchestrator's built-in worker, provisioned by the server.
CREATABLE_TYPES = (WorkerType.PERSISTENT, WorkerType.EPHEMERAL)


def parse_label_pairs(pairs, *, example="gpu=a100"):
    """Return ``{key: value}`` from ``KEY=VALUE`` strings (blank ones skipped).

    Raise InvalidInput on a malformed or repeated one.
    """
    labels = {}
    for raw in pairs or ():
        if not raw.strip():
            continue
        key, sep, value = raw.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidInput(f"bad label {raw.strip()!r}: expected KEY=VALUE, e.g. {example}", code="invalid_labels")
        if key in labels:
            raise InvalidInput(f"label {key!r} given twice", code="invalid_labels")
        labels[key] = value.strip()
    return labels


# The agent as the README installs it: `make install` puts `simpletuner` in the checkout's .venv/bin, not on PATH.
AGENT_PROGRAM = ".venv/bin/simpletuner"


def agent_command_line(*, worker, token, orchestrator_url):
    """Return the shell line that starts ``worker``'s agent with ``token`` in its environment, run from a
    checkout set up as the README says (docs/agent-guide.md: an agent-only install runs `simpletuner worker`)."""
    argv = [AGENT_PROGRAM, "worker", "--orchestrator-url", orchestrator_url, "--name", worker.name]
    if worker.worker_type == WorkerType.PERSISTENT:
        argv.append("--persistent")  # the agent's default is ephemeral: exit after one job
    return f"SIMPLETUNER_WORKER_TOKEN={shlex.quote(token)} {shlex.join(argv)}"
