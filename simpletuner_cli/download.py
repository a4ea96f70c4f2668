"""`simpletuner jobs download`: every artifact of a job, resumed where a file was left, each checked by its SHA-256."""

import hashlib
import os
from pathlib import Path
from urllib.parse import urlsplit

from .client import TOOL_ERROR
from .errors import CLIError
from .render import human_bytes

CHUNK_BYTES = 1024 * 1024
PARTIAL_SUFFIX = ".part"


def local_path(dest, key):
    """Return where artifact ``key`` goes under ``dest``; raise CLIError for a key that would leave it."""
    parts = key.split("/")
    if any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise CLIError(f"refusing artifact key {key!r}: it would be written outside {dest}", TOOL_ERROR)
    return Path(dest).joinpath(*parts)


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download_artifact(client, artifact, dest, *, out):
    """Download one artifact into ``dest`` (resuming its ``.part`` file with a Range request); return its path.

    Raise CLIError when the file's SHA-256 is not the artifact's (the partial file is removed: run again)."""
    target = local_path(dest, artifact["key"])
    size, sha256 = artifact["size"], artifact["sha256"]
    if target.exists() and target.stat().st_size == size and file_sha256(target) == sha256:
        out.write(f"{artifact['key']}  {human_bytes(size)}  already here, sha256 ok\n")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + PARTIAL_SUFFIX)
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        have = 0
    resumed = 0
    if have < size:
        headers = {"Range": f"bytes={have}-", "If-Range": f'"{sha256}"'} if have else {}
        url = artifact["download_url"]
        path = url[len(client.url) :] if url.startswith(client.url + "/") else urlsplit(url).path
        response = client.request("GET", path, what=f"download {artifact['key']}", ok=(200, 206), stream=True, headers=headers)
        with response:
            resumed = have if response.status_code == 206 else 0
            with open(partial, "ab" if resumed else "wb") as sink:
                for chunk in response.iter_content(chunk_size=CHUNK_BYTES):
                    sink.write(chunk)
    got = file_sha256(partial)
    if got != sha256:
        partial.unlink(missing_ok=True)
        raise CLIError(
            f"{artifact['key']}: SHA-256 {got} is not the server's {sha256}; the partial file was removed, run the download again",
            TOOL_ERROR,
        )
    os.replace(partial, target)
    note = f", resumed at {resumed} bytes" if resumed else ""
    out.write(f"{artifact['key']}  {human_bytes(size)}  sha256 ok{note}\n")
    out.flush()
    return target


def download_job(client, job_id, dest, *, out):
    """Download every artifact of job ``job_id`` into ``dest`` (default: a directory named after the job); return
    how many files."""
    job = client.job(job_id)
    artifacts = job.get("artifacts") or []
    dest = Path(dest) if dest else Path(job_id)
    if not artifacts:
        out.write(f"job {job_id} has no artifacts ({job['status']})\n")
        return 0
    for artifact in artifacts:
        download_artifact(client, artifact, dest, out=out)
    out.write(f"{len(artifacts)} file(s) in {dest}\n")
    return len(artifacts)
