"""Command line and environment of the agent: ``python -m worker_agent`` and ``simpletuner worker``."""

import argparse
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .client import AgentError

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off", "")
DEFAULT_HEARTBEAT_INTERVAL = 30.0
DEFAULT_CANCEL_GRACE = 30.0


class ConfigError(AgentError):
    """A missing or invalid setting: reported as one line, exit status 2."""


@dataclass
class AgentConfig:
    """Everything the agent needs, resolved from flags (which win) and environment variables."""

    orchestrator_url: str
    token: str
    name: str
    persistent: bool
    verify: object  # True, a CA bundle path, or False
    work_dir: Path
    command: str | None
    heartbeat_interval: float | None  # None: the orchestrator's value from register
    cancel_grace: float
    verbose: int = 0
    gpus: list | None = None  # --gpus: the GPU indices this agent may use (None: every GPU NVML sees)
    advertise_address: str | None = None  # --advertise-address: where other workers reach this one


def add_arguments(parser):
    """Add the agent's options to ``parser`` (used by both entry points)."""
    parser.add_argument(
        "--orchestrator-url", metavar="URL", help="orchestrator panel URL (or SIMPLETUNER_ORCHESTRATOR_URL)"
    )
    parser.add_argument("--worker-token", metavar="TOKEN", help="authentication token (or SIMPLETUNER_WORKER_TOKEN)")
    parser.add_argument("--name", metavar="NAME", help="worker name (or SIMPLETUNER_WORKER_NAME; default: hostname)")
    parser.add_argument(
        "--persistent",
        action="store_true",
        default=None,
        help="stay online between jobs (or SIMPLETUNER_WORKER_PERSISTENT=true; default: ephemeral, exit after one job); "
        "the worker's type, set by the operator who created it, wins: the agent says so at start when they differ",
    )
    parser.add_argument(
        "--ssl-no-verify",
        action="store_true",
        help="accept any TLS certificate (self-signed orchestrators; development only)",
    )
    parser.add_argument(
        "--ca-cert", metavar="PATH", type=Path, help="CA certificate (PEM) to verify the orchestrator's certificate with"
    )
    parser.add_argument(
        "--work-dir",
        metavar="PATH",
        type=Path,
        help="where job directories go (or SIMPLETUNER_WORK_DIR; default: ~/.simpletuner/jobs)",
    )
    parser.add_argument(
        "--command",
        metavar="CMD",
        help="training command, split like a shell line (or SIMPLETUNER_WORKER_COMMAND; "
        "default: python -m simpletuner.train)",
    )
    parser.add_argument(
        "--gpus",
        metavar="LIST",
        help="GPU indices this agent may use, e.g. 0,1,2,3 (or SIMPLETUNER_WORKER_GPUS; default: every GPU NVML sees); "
        "on a node where NVML sees no GPU, declares that many GPU slots",
    )
    parser.add_argument(
        "--advertise-address",
        metavar="HOST",
        help="address other workers reach this one at for a multi-node job's rendezvous (or SIMPLETUNER_WORKER_ADDRESS; "
        "default: the address the orchestrator sees the agent at)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="enable debug logging")
    return parser


def build_parser(prog="simpletuner worker"):
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a SimpleTuner GPU worker: register with the orchestrator, take training jobs "
        "pushed over Server-Sent Events, run them and report back.",
        epilog="Environment: SIMPLETUNER_HEARTBEAT_INTERVAL (seconds, default: the orchestrator's, 30), "
        "SIMPLETUNER_CANCEL_GRACE (seconds between SIGTERM and SIGKILL when a job is stopped, default 30).",
    )
    return add_arguments(parser)


def _env_bool(env, name):
    raw = env.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def _env_seconds(env, name, default):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {raw!r}")
    return value


def parse_gpus(raw, source="--gpus"):
    """Return the GPU indices in ``raw`` (``"0,1,2,3"``) as a list of distinct non-negative integers, or None when
    ``raw`` is absent or blank. Raise ConfigError for anything else."""
    if raw is None or raw.strip() == "":
        return None
    indices = []
    for part in raw.split(","):
        text = part.strip()
        if not (text.isascii() and text.isdigit()):
            raise ConfigError(
                f"{source} must be a comma-separated list of GPU indices, e.g. 0,1,2,3; got {raw!r}"
            )
        index = int(text)
        if index in indices:
            raise ConfigError(f"{source} names GPU {index} twice: {raw!r}")
        indices.append(index)
    return indices


def resolve_config(args, env=None):
    """Return the AgentConfig for parsed ``args``; flags win over ``env``. Raise ConfigError."""
    env = os.environ if env is None else env
    url = (args.orchestrator_url or env.get("SIMPLETUNER_ORCHESTRATOR_URL") or "").strip()
    if not url:
        raise ConfigError(
            "no orchestrator URL", fix="pass --orchestrator-url https://HOST:8001 or set SIMPLETUNER_ORCHESTRATOR_URL"
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"orchestrator URL must be http(s)://HOST[:PORT], got {url!r}",
            fix="e.g. --orchestrator-url https://orchestrator.example.com:8001",
        )
    token = (args.worker_token or env.get("SIMPLETUNER_WORKER_TOKEN") or "").strip()
    if not token:
        raise ConfigError(
            "no worker token",
            fix="pass --worker-token or set SIMPLETUNER_WORKER_TOKEN (create one in admin → Workers, "
            "or POST /api/admin/workers)",
        )
    persistent = args.persistent if args.persistent is not None else _env_bool(env, "SIMPLETUNER_WORKER_PERSISTENT")
    if args.ssl_no_verify and args.ca_cert:
        raise ConfigError("--ssl-no-verify and --ca-cert contradict each other; give one")
    verify = True
    if args.ssl_no_verify:
        verify = False
    elif args.ca_cert:
        if not args.ca_cert.is_file():
            raise ConfigError(f"--ca-cert {args.ca_cert}: no such file")
        verify = str(args.ca_cert)
    work_dir = args.work_dir or Path(env.get("SIMPLETUNER_WORK_DIR") or Path.home() / ".simpletuner" / "jobs")
    gpus_flag = getattr(args, "gpus", None)
    if gpus_flag is not None:
        gpus = parse_gpus(gpus_flag)
        if gpus is None:
            raise ConfigError("--gpus is empty: give GPU indices, e.g. --gpus 0,1, or leave the flag out")
    else:
        gpus = parse_gpus(env.get("SIMPLETUNER_WORKER_GPUS"), "SIMPLETUNER_WORKER_GPUS")
    address = (getattr(args, "advertise_address", None) or env.get("SIMPLETUNER_WORKER_ADDRESS") or "").strip() or None
    heartbeat = None
    if env.get("SIMPLETUNER_HEARTBEAT_INTERVAL"):
        heartbeat = _env_seconds(env, "SIMPLETUNER_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL)
    return AgentConfig(
        orchestrator_url=url.rstrip("/"),
        token=token,
        name=(args.name or env.get("SIMPLETUNER_WORKER_NAME") or socket.gethostname()).strip(),
        persistent=bool(persistent),
        verify=verify,
        work_dir=Path(work_dir).expanduser().resolve(),
        command=args.command or env.get("SIMPLETUNER_WORKER_COMMAND") or None,
        heartbeat_interval=heartbeat,
        cancel_grace=_env_seconds(env, "SIMPLETUNER_CANCEL_GRACE", DEFAULT_CANCEL_GRACE),
        verbose=args.verbose,
        gpus=gpus,
        advertise_address=address,
    )


def configure_logging(verbose):
    """Plain console lines on stderr; -v adds debug logs (and the HTTP library's)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose else "%(asctime)s %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose < 2:
        logging.getLogger("urllib3").setLevel(logging.INFO)


def run(args, *, env=None):
    """Run the agent for parsed ``args``; return the exit status."""
    from .agent import Agent

    try:
        config = resolve_config(args, env)
    except ConfigError as exc:
        print(f"simpletuner worker: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.verbose)
    try:
        work_dir = config.work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"simpletuner worker: error: cannot create work dir {config.work_dir}: {exc.strerror}", file=sys.stderr)
        return 2
    return Agent(config).run()


def main(argv=None):
    """``python -m worker_agent`` (and ``simpletuner-worker``): parse ``argv`` and run; return the exit status."""
    args = build_parser("python -m worker_agent").parse_args(argv)
    return run(args)


def simpletuner_main(argv=None):
    """``simpletuner`` as installed on a GPU node by the agent alone: only the ``worker`` command exists.

    (The orchestrator's own ``simpletuner`` has ``server`` and ``worker``; both run this same agent.)
    """
    parser = argparse.ArgumentParser(
        prog="simpletuner", description="SimpleTuner worker agent (agent-only install: no `server` command here)."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_arguments(commands.add_parser("worker", help="run a GPU worker", description=build_parser().description))
    args = parser.parse_args(argv)
    return run(args)
