"""The user commands' handlers: `login`, `jobs ...`, `configs ...`, `workers list`. Each returns its exit status."""

import getpass
import json
import sys
from pathlib import Path
from urllib.parse import quote

from . import render
from .client import TOOL_ERROR, Client, Credentials, load_credentials, normalise_url, save_credentials
from .download import download_job
from .errors import CLIError
from .follow import JobWatch, LogFollower


def connect():
    """Return a Client for the stored (or environment's) credentials."""
    return Client(load_credentials())


def _print(text=""):
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# --- login ---------------------------------------------------------------------------------------------


def read_token(stdin=None):
    """Return the token typed or piped on stdin: without echo when stdin is a terminal."""
    stdin = stdin or sys.stdin
    if stdin.isatty():
        token = getpass.getpass("API token (not shown): ")
    else:
        token = stdin.readline()
    token = token.strip()
    if not token:
        raise CLIError("no token given: pass --token, or type or pipe it on stdin", TOOL_ERROR)
    return token


def run_login(args):
    url = normalise_url(args.url)
    token = args.token or read_token()
    client = Client(Credentials(url=url, token=token))
    response = client.request("GET", "/api/queue/", params={"limit": 1}, what="check the token", ok=(200, 403))
    path = save_credentials(client.credentials)
    note = "" if response.status_code == 200 else " (the token is valid, but its user may not view jobs)"
    _print(f"logged in to {url}{note}; credentials saved in {path} (readable by you only)")
    return 0


# --- jobs ------------------------------------------------------------------------------------------------


def parse_label(raw):
    """Return ``KEY=GLOB`` as ``(key, glob)``; raise ValueError (argparse's message) for another shape."""
    key, sep, glob = raw.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"a label is KEY=GLOB, not {raw!r}")
    return key.strip(), glob


def read_config_file(path):
    """Return the JSON object in ``path``; CLIError when unreadable or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror}", TOOL_ERROR) from None
    except ValueError as exc:
        raise CLIError(f"{path} is not JSON: {exc}", TOOL_ERROR) from None
    if not isinstance(value, dict):
        raise CLIError(f"{path} must hold a JSON object (the trainer's config)", TOOL_ERROR)
    return value


def submit_body(args):
    """Return the submit request's body for `jobs submit`'s arguments."""
    if not args.config_name and not args.config:
        raise CLIError("name a stored config (CONFIG_NAME[@VERSION]) or give --config FILE.json", TOOL_ERROR)
    body = {"config_name": args.config_name or Path(args.config).stem, "target": args.target}
    if args.config:
        body["config"] = read_config_file(args.config)
    if args.label:
        body["worker_labels"] = dict(args.label)
    if args.gpus is not None:
        body["gpu_count"] = args.gpus
    if getattr(args, "nodes", None) is not None:
        body["num_nodes"] = args.nodes
    if args.priority is not None:
        body["priority"] = args.priority
    if getattr(args, "team", None):
        body["team"] = args.team
    return body


def run_submit(args):
    client = connect()
    job = client.post_json("/api/queue/submit", submit_body(args), what="submit the job")
    _print(job["id"])
    if job["status"] == "queued" and job.get("waiting_reason"):
        _print(f"waiting: {job['waiting_reason']}")
    if args.follow:
        return JobWatch(client, job["id"]).run(job)
    return 0


def run_list(args):
    params = {}
    if args.status:
        params["status"] = args.status
    if args.mine:
        params["mine"] = "true"
    return _listing(list(connect().pages("/api/queue/", params=params, limit=args.limit)), render.JOB_COLUMNS, args, "no jobs")


def _listing(items, columns, args, empty):
    """Print ``items`` as the API's JSON (--json), else as a table of ``columns`` (``empty`` when there are none)."""
    if args.json:
        _print(render.as_json(items))
    else:
        _print(render.table(items, columns) if items else empty)
    return 0


def run_show(args):
    job = connect().job(args.job_id)
    _print(render.as_json(job) if args.json else "\n".join(render.job_details(job)))
    return 0


def run_cancel(args):
    job = connect().job_action(args.job_id, "cancel")
    _print(f"{job['id']} {job['status']}")
    return 0


def run_retry(args):
    job = connect().job_action(args.job_id, "retry")
    _print(job["id"])
    if job["status"] == "queued" and job.get("waiting_reason"):
        _print(f"waiting: {job['waiting_reason']}")
    return 0


def run_logs(args):
    client = connect()
    if args.follow:
        client.job(args.job_id)  # a clear error for a job that does not exist
        return LogFollower(client, args.job_id).run()
    response = client.request("GET", f"/api/queue/{quote(args.job_id, safe='')}/log", ok=(200, 404))
    if response.status_code == 404:
        raise CLIError(f"no job {args.job_id} on {client.url} (simpletuner jobs list shows them)", TOOL_ERROR)
    sys.stdout.write(response.content.decode("utf-8", "replace"))
    sys.stdout.flush()
    return 0


def run_watch(args):
    return JobWatch(connect(), args.job_id).run()


def run_download(args):
    download_job(connect(), args.job_id, args.dest, out=sys.stdout)
    return 0


# --- configs and workers ------------------------------------------------------------------------------------


def split_version(raw):
    """Return ``NAME[@VERSION]`` as ``(name, version or None)``; CLIError for a version that is not a number."""
    name, sep, version = raw.rpartition("@") if "@" in raw else (raw, "", "")
    if sep and not version.isdigit():
        raise CLIError(f"{raw!r}: a version is a number (NAME@3)", TOOL_ERROR)
    return name, int(version) if sep else None


def run_configs_push(args):
    body = {"name": args.name, "config": read_config_file(args.file)}
    stored = connect().post_json("/api/configs", body, what="store the config")
    _print(f"{stored['name']} version {stored['version']}")
    return 0


def run_configs_list(args):
    return _listing(list(connect().pages("/api/configs")), render.CONFIG_COLUMNS, args, "no stored configs")


def run_configs_show(args):
    name, version = split_version(args.name)
    detail = connect().config(name)
    versions = detail.get("versions") or []
    chosen = next((v for v in versions if v["version"] == (version or detail.get("latest"))), None)
    if chosen is None:
        known = ", ".join(str(v["version"]) for v in versions)
        raise CLIError(f"config {name} has no version {version} (it has {known})", TOOL_ERROR)
    if args.json:
        _print(render.as_json(chosen))
        return 0
    _print(f"{chosen['name']} version {chosen['version']} (latest {detail.get('latest')}), by {chosen.get('owner') or '-'}")
    if chosen.get("description"):
        _print(chosen["description"])
    _print(render.as_json(chosen.get("config")))
    if chosen.get("dataloader") is not None:
        _print("dataloader:")
        _print(render.as_json(chosen["dataloader"]))
    return 0


def run_workers_list(args):
    body = connect().get_json("/api/admin/workers", params={"status": args.status} if args.status else None)
    workers = body.get("workers", []) if isinstance(body, dict) else body
    return _listing(workers, render.WORKER_COLUMNS, args, "no workers")
