"""The user commands' arguments: `simpletuner login`, `jobs`, `configs`, `workers` (handlers in ``jobs``)."""

import argparse

from . import jobs
from .client import CONFIG_HOME_ENV, TOKEN_ENV, TOOL_ERROR, URL_ENV

JOB_STATUSES = ("queued", "dispatched", "running", "completed", "failed", "cancelled")
ENVIRONMENT = (
    "environment:\n"
    f"  {URL_ENV:<19} the server's URL, over the one `simpletuner login` stored\n"
    f"  {TOKEN_ENV:<19} the API token, over the stored one (never printed)\n"
    f"  {CONFIG_HOME_ENV:<19} where the credentials file lives ($XDG_CONFIG_HOME/simpletuner/credentials,\n"
    f"  {'':<19} default ~/.config/simpletuner/credentials, mode 0600)\n"
    f"  {'REQUESTS_CA_BUNDLE':<19} a CA certificate (PEM) to trust, e.g. a server's self-signed one\n"
)
EXIT_STATUSES = "exit status: 0 the job completed, 1 it failed, 2 it was cancelled, 3 an error of this tool\n"


def _command(subcommands, name, handler, help, *, description=None, extra_epilog=""):
    parser = subcommands.add_parser(
        name,
        help=help,
        description=description or help[0].upper() + help[1:] + ".",
        epilog=extra_epilog + ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=handler)
    parser.usage_status = TOOL_ERROR  # a bad argument is a tool error: 1 and 2 are a job's failure and cancellation
    return parser


def _group(subcommands, name, help):
    parser = subcommands.add_parser(
        name, help=help, description=help[0].upper() + help[1:] + ".", epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.usage_status = TOOL_ERROR
    return parser.add_subparsers(dest="action", required=True, metavar="ACTION")


def _label(raw):
    try:
        return jobs.parse_label(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(raw):
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _whole(raw):
    try:
        return int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {raw!r}") from None


def add_user_commands(subcommands):
    """Add `login`, `jobs`, `configs` and `workers` to the `simpletuner` parser's ``subcommands``."""
    login = _command(
        subcommands, "login", jobs.run_login, "store the server's URL and your API token for the other commands",
        description="Check the API token against the server, then store the URL and token in the credentials file "
        "(mode 0600). Without --token the token is read from stdin, without echo on a terminal.",
    )  # fmt: skip
    login.add_argument("--url", required=True, help="the orchestrator, e.g. https://orchestrator.example:8001")
    login.add_argument("--token", help="an operator API token (sta_...); prefer stdin: a flag shows in ps")
    add_jobs(_group(subcommands, "jobs", "submit, list, follow and fetch training jobs"))
    add_configs(_group(subcommands, "configs", "store and read training configs"))
    workers = _group(subcommands, "workers", "see the fleet")
    listing = _command(workers, "list", jobs.run_workers_list, "list the workers")
    listing.add_argument("--status", help="only these statuses, comma-separated (idle,busy,...)")
    listing.add_argument("--json", action="store_true", help="print the API's objects as JSON")


def add_jobs(actions):
    submit = _command(
        actions, "submit", jobs.run_submit, "submit a training job; print its id (and why it waits, if it does)",
        extra_epilog="with --follow, " + EXIT_STATUSES,
    )  # fmt: skip
    submit.add_argument("config_name", nargs="?", metavar="CONFIG_NAME[@VERSION]", help="a stored config (latest version, or @VERSION)")
    submit.add_argument("--config", metavar="FILE.json", help="the trainer's config as a JSON file (over the stored one's keys)")
    submit.add_argument("--label", action="append", type=_label, metavar="KEY=GLOB", help="run only on workers whose label KEY matches GLOB (repeatable)")
    submit.add_argument("--gpus", type=_whole, metavar="N", help="GPUs the job needs (default: the config's num_processes, else any)")
    submit.add_argument("--nodes", type=_whole, metavar="N", help="workers it runs on at once, each giving it --gpus (default 1)")
    submit.add_argument("--target", choices=("worker", "local", "auto"), default="worker", help="where it runs (default: worker)")
    submit.add_argument("--priority", type=_whole, metavar="N", help="higher runs first (-1000..1000, default 0)")
    submit.add_argument("--team", metavar="NAME", help="the team the job is charged to (default: yours, if you are in one)")
    submit.add_argument("--follow", action="store_true", help="then watch it to its end, as jobs watch")

    listing = _command(actions, "list", jobs.run_list, "list jobs, newest first")
    listing.add_argument("--status", help=f"only these statuses, comma-separated ({', '.join(JOB_STATUSES)})")
    listing.add_argument("--mine", action="store_true", help="only the jobs you submitted")
    listing.add_argument("--limit", type=_positive, default=50, metavar="N", help="at most N jobs (default 50)")
    listing.add_argument("--json", action="store_true", help="print the API's objects as JSON")

    show = _command(actions, "show", jobs.run_show, "show a job: status, progress, attempts, artifacts")
    show.add_argument("job_id", metavar="ID")
    show.add_argument("--json", action="store_true", help="print the API's object as JSON")

    for name, handler, help in (
        ("cancel", jobs.run_cancel, "cancel a job (a running one is stopped on its worker)"),
        ("retry", jobs.run_retry, "retry a failed or cancelled job as a new job; print its id"),
    ):
        _command(actions, name, handler, help).add_argument("job_id", metavar="ID")

    logs = _command(
        actions, "logs", jobs.run_logs, "print a job's whole log",
        extra_epilog="with --follow, " + EXIT_STATUSES,
    )  # fmt: skip
    logs.add_argument("job_id", metavar="ID")
    logs.add_argument("--follow", "-f", action="store_true", help="then print new lines as they come, until the job ends")

    watch = _command(
        actions, "watch", jobs.run_watch,
        "follow a job to its end: a progress bar (step of total, loss, ETA) and its state changes, as the server pushes "
        "them; one plain line per change when stdout is not a terminal",
        extra_epilog=EXIT_STATUSES,
    )  # fmt: skip
    watch.add_argument("job_id", metavar="ID")

    download = _command(
        actions, "download", jobs.run_download,
        "download every artifact of a job, resuming partial files (FILE.part), each checked against its SHA-256",
    )  # fmt: skip
    download.add_argument("job_id", metavar="ID")
    download.add_argument("--dest", metavar="DIR", help="where to put them (default: ./ID)")


def add_configs(actions):
    push = _command(actions, "push", jobs.run_configs_push, "store a config: a new name, or the name's next version")
    push.add_argument("name", metavar="NAME")
    push.add_argument("file", metavar="FILE.json", help="the trainer's config, a JSON object")
    listing = _command(actions, "list", jobs.run_configs_list, "list the stored configs (latest version of each)")
    listing.add_argument("--json", action="store_true", help="print the API's objects as JSON")
    show = _command(actions, "show", jobs.run_configs_show, "show a stored config (its latest version, or @VERSION)")
    show.add_argument("name", metavar="NAME[@VERSION]")
    show.add_argument("--json", action="store_true", help="print the API's object as JSON")
