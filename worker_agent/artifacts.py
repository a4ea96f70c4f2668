"""The agent's side of the artifact store: upload a job's output directory, fetch the checkpoint it resumes from.

Every request carries the attempt's upload token (``protocol.UPLOAD_TOKEN_HEADER``) and a timeout;
connection errors, timeouts, 5xx and 429 are retried with backoff (``Retry-After`` honoured), any other
refusal (400, 401, 409 stale attempt, 413) is final. Uploads resume: a manifest in the job directory
records each file already stored (size, mtime, SHA-256), so a retried or restarted upload sends only
what is missing or changed.
"""

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import requests

from . import protocol
from .backoff import Backoff

logger = logging.getLogger(__name__)

TIMEOUT = (10, 300)  # (connect, read) seconds per request
TRIES = 4  # a few seconds: an unreachable orchestrator must not hold up the job's result
CHUNK = 1024 * 1024
OUTPUT_BUCKET = "output"
MANIFEST_FILE = "uploaded.json"


class TransferError(Exception):
    """An upload or download that cannot succeed (refused, or still failing after every retry)."""

    def __init__(self, message, *, status=None, code=""):
        super().__init__(message)
        self.status = status
        self.code = code


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


class ArtifactTransfer:
    """Transfers for one attempt: ``base_url`` is the orchestrator's, ``upload_endpoint`` the ``job_submit``'s."""

    def __init__(self, *, base_url, upload_endpoint, token, verify=True, session=None, sleep=time.sleep, backoff=None, tries=TRIES):
        if upload_endpoint.startswith(("http://", "https://")):
            self.endpoint_url = upload_endpoint.rstrip("/")
        else:
            self.endpoint_url = base_url.rstrip("/") + "/" + upload_endpoint.strip("/")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.verify = verify
        self.session = session or requests.Session()
        self.sleep = sleep
        self.backoff = backoff or Backoff(base=0.5, cap=10.0)
        self.tries = tries

    # --- one request, retried ---------------------------------------------------------------------

    def _request(self, method, url, *, body=None, stream=False, headers=None):
        """Send ``method url`` until it is answered below 400; return the response. ``body`` is a callable
        returning a fresh body for each try. Raise TransferError when refused or out of tries."""
        headers = {protocol.UPLOAD_TOKEN_HEADER: self.token, "Content-Type": "application/octet-stream", **(headers or {})}
        self.backoff.reset()
        for attempt in range(1, self.tries + 1):
            data = body() if body is not None else None
            wait = None
            try:
                response = self.session.request(
                    method, url, data=data, stream=stream, timeout=TIMEOUT, verify=self.verify, headers=headers,
                )  # fmt: skip
            except requests.RequestException as exc:
                reason = f"{exc.__class__.__name__}"
            else:
                if response.status_code < 400:
                    return response
                reason, wait = self._refusal(method, url, response)
            finally:
                if data is not None and hasattr(data, "close"):
                    data.close()
            if attempt == self.tries:
                raise TransferError(f"{method} {url} failed {self.tries} times (last: {reason})")
            delay = self.backoff.next_delay(wait or 0)
            logger.warning("%s %s: %s; retrying in %.0fs", method, url, reason, delay)
            self.sleep(delay)
        raise AssertionError("unreachable")

    @staticmethod
    def _refusal(method, url, response):
        """Return ``(reason, retry after)`` for a transient answer; raise TransferError for a final one."""
        try:
            payload = response.json()
        except ValueError:
            payload = {}
        payload = payload if isinstance(payload, dict) else {}
        status = response.status_code
        detail = str(payload.get("detail") or response.reason or "")
        response.close()
        if status == 429 or status >= 500:
            try:
                wait = float(response.headers.get("Retry-After", ""))
            except ValueError:
                wait = None
            return f"HTTP {status} {detail}".strip(), wait
        raise TransferError(f"{method} {url} refused: HTTP {status} {detail}".strip(), status=status, code=str(payload.get("code") or ""))

    # --- uploads ----------------------------------------------------------------------------------

    def object_url(self, bucket, key):
        return f"{self.endpoint_url}/{quote(bucket)}/{quote(key)}"

    def upload_file(self, path, bucket, key, *, headers=None):
        """PUT ``path`` as ``bucket/key``; return the server's answer (``sha256``, ``size``...). Raise TransferError."""
        response = self._request("PUT", self.object_url(bucket, key), body=lambda: open(path, "rb"), headers=headers)
        try:
            return response.json()
        except ValueError:
            return {}
        finally:
            response.close()

    def upload_dir(self, directory, *, manifest_path, bucket=OUTPUT_BUCKET):
        """Upload every file under ``directory`` (keys: its relative paths) not recorded unchanged in the
        manifest; return how many were sent. Raise TransferError on the first that cannot be."""
        directory = Path(directory)
        if not directory.is_dir():
            return 0
        paths = sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())
        return self._upload_files(directory, paths, manifest_path=manifest_path, bucket=bucket)

    def _upload_files(self, root, paths, *, manifest_path, bucket=OUTPUT_BUCKET, headers=None):
        """Upload ``paths`` in order (keys: their paths relative to ``root``), skipping those the manifest
        records unchanged; return how many were sent. Raise TransferError (OSError for a file gone meanwhile)."""
        manifest = _read_manifest(manifest_path)
        sent = 0
        for path in paths:
            key = path.relative_to(root).as_posix()
            stat = path.stat()
            if manifest.get(key, [None, None])[:2] == [stat.st_size, stat.st_mtime_ns]:
                continue
            digest = file_sha256(path)
            answer = self.upload_file(path, bucket, key, headers=headers)
            if answer.get("sha256") not in (None, digest):
                raise TransferError(f"{key}: the orchestrator stored SHA-256 {answer.get('sha256')}, not {digest}")
            manifest[key] = [stat.st_size, stat.st_mtime_ns, digest]
            _write_manifest(manifest_path, manifest)
            sent += 1
        return sent

    def upload_checkpoint(self, directory, step, *, manifest_path, last=(), bucket=OUTPUT_BUCKET):
        """Upload every file of checkpoint directory ``directory`` (of ``step``; keys relative to its parent, the
        output directory) as a checkpoint this attempt declares, the files named in ``last`` (its marker) after
        the others, then declare it complete; return how many files were sent. Raise TransferError or OSError."""
        directory = Path(directory)
        paths = sorted(
            (p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()),
            key=lambda p: (p.relative_to(directory).as_posix() in last, p.relative_to(directory).as_posix()),
        )
        headers = {protocol.CHECKPOINT_DECLARES_HEADER: "1"}
        sent = self._upload_files(directory.parent, paths, manifest_path=manifest_path, bucket=bucket, headers=headers)
        self.declare_checkpoint(step)
        return sent

    def declare_checkpoint(self, step):
        """Tell the orchestrator this attempt's ``checkpoint-<step>`` is complete."""
        self._request("POST", self.base_url + protocol.checkpoint_complete_path(step)).close()

    # --- resume -----------------------------------------------------------------------------------

    def download_checkpoint(self, resume, output_dir, *, manifest_path=None):
        """Fetch the files of ``resume`` (a ``protocol.ResumeCheckpoint``) into ``output_dir/checkpoint-<step>/``,
        each checked against its SHA-256; return that directory. Raise TransferError."""
        output_dir = Path(output_dir)
        manifest = _read_manifest(manifest_path) if manifest_path else {}
        for item in resume.get("files") or []:
            relative = protocol.checkpoint_relative_path(item["key"])
            target = output_dir / relative
            if output_dir.resolve() not in target.resolve().parents:
                raise TransferError(f"{item['key']}: outside the output directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            url = item["download_url"]
            url = url if url.startswith(("http://", "https://")) else self.base_url + url
            self._download(url, target, item["sha256"])
            stat = target.stat()
            manifest[relative] = [stat.st_size, stat.st_mtime_ns, item["sha256"]]
        if manifest_path:
            _write_manifest(manifest_path, manifest)
        return output_dir / resume["checkpoint"]

    def _download(self, url, target, sha256):
        response = self._request("GET", url, stream=True)
        digest = hashlib.sha256()
        descriptor, temporary = tempfile.mkstemp(prefix=".download.", dir=target.parent)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                for block in response.iter_content(CHUNK):
                    digest.update(block)
                    handle.write(block)
            if digest.hexdigest() != sha256:
                raise TransferError(f"{url}: SHA-256 {digest.hexdigest()} does not match {sha256}")
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        finally:
            response.close()


def _read_manifest(path):
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_manifest(path, manifest):
    path = Path(path)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(temporary, path)
