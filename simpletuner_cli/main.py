"""The `simpletuner` console script's arguments: `server` runs the orchestrator, `worker` the agent; `login`, `jobs`,
`configs` and `workers` are the users' commands (``commands``), clients of the REST API."""

import argparse
import os
import sys
from pathlib import Path

from .commands import add_user_commands
from .endpoints import parse_host, parse_port
from .errors import CLIError
from .serve import run_server

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8001
WORKER_HELP = "run the worker agent on a GPU node (the same program as python -m worker_agent)"
WORKER_DESCRIPTION = (
    "Register with an orchestrator, keep its event stream open and run the training jobs it sends. "
    "The worker token is read from SIMPLETUNER_WORKER_TOKEN (or --worker-token)."
)


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser that reports a bad argument as one line on stderr (exit status ``usage_status``: 2, and 3
    for the user commands, whose 1 and 2 say how a job ended)."""

    usage_status = 2

    def error(self, message):
        self.exit(self.usage_status, f"{self.prog}: error: {message} (see --help)\n")


def add_server_command(subcommands):
    """Add `simpletuner server`, handled by ``serve.run_server``."""
    parser = subcommands.add_parser(
        "server",
        help="run the orchestrator (REST API, worker streams, admin)",
        description="Apply database migrations, then serve the orchestrator with daphne (ASGI).",
    )
    parser.add_argument(
        "--host",
        type=parse_host,
        default=DEFAULT_HOST,
        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; "
        "--host 0.0.0.0 exposes the server on every IPv4 interface). Outside production mode the server answers "
        "requests for this address, the loopback names and this machine's names (DJANGO_ALLOWED_HOSTS replaces them)",
    )
    parser.add_argument("--port", type=parse_port, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument(
        "--ssl",
        action="store_true",
        help="serve HTTPS; without --ssl-certfile/--ssl-keyfile a self-signed certificate is generated "
        "into <data dir>/tls on first use and its SHA-256 fingerprint printed at every start",
    )
    parser.add_argument("--ssl-certfile", type=Path, metavar="PATH", help="PEM certificate (implies --ssl)")
    parser.add_argument("--ssl-keyfile", type=Path, metavar="PATH", help="PEM private key, unencrypted (implies --ssl)")
    parser.add_argument(
        "--no-migrate", dest="migrate", action="store_false", help="do not apply database migrations at start"
    )
    parser.add_argument(
        "--proxy-headers",
        action="store_true",
        help="take the client address and scheme from X-Forwarded-For/-Port/-Proto (behind a reverse proxy only)",
    )
    parser.add_argument(
        "--no-local-worker",
        dest="local_worker",
        action="store_false",
        help="do not start the built-in local worker (the agent on this machine). Jobs with target local "
        "run only on it and wait without it; auto jobs prefer an idle matching remote worker and fall back to it",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request to stdout")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: migration output, access log and the local worker's debug output; -vv: also Twisted's log",
    )
    parser.set_defaults(handler=run_server)


def add_worker_command(subcommands):
    """Add `simpletuner worker`, whose arguments and handler are ``worker_agent.cli``'s (one program)."""
    from worker_agent.cli import add_arguments, run

    parser = subcommands.add_parser("worker", help=WORKER_HELP, description=WORKER_DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(handler=run)


def build_parser():
    """Return the parser of `simpletuner` and its subcommands."""
    parser = ArgumentParser(prog="simpletuner", description="SimpleTuner orchestrator.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_server_command(subcommands)
    add_worker_command(subcommands)
    add_user_commands(subcommands)
    return parser


def main(argv=None):
    """Run the console script; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
    try:
        return args.handler(args)
    except CLIError as exc:
        print(f"simpletuner {command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        if args.command in ("server", "worker"):
            raise
        print(f"simpletuner {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output left (`| head`): stop quietly, as a shell tool does
        if args.command in ("server", "worker"):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 0

