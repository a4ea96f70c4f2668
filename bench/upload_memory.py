"""Measure the server's memory while it receives one large artifact upload (issue 15: bounded memory), and sends it back.

Usage:  python bench/upload_memory.py [--mb 1024] [--server cli|daphne] [--port 8401] [--read-mib-per-s N]

Migrates a fresh SQLite data dir, creates a worker holding a running job (its attempt's upload
token is what the trainer would get), starts the orchestrator (``cli``: ``simpletuner server``, which
hands request bodies over from daphne's spool file; ``daphne``: plain ``python -m daphne``), PUTs
``--mb`` MiB of generated data to ``/api/cloud/storage/<bucket>/<key>`` with Content-Length while
sampling the server process's RSS every 20 ms, checks the SHA-256 the server recorded, and prints
the baseline RSS, the peak RSS and the time taken. Then it downloads the file again with the same token
(the resume download of a checkpoint), reading it at ``--read-mib-per-s`` (0: as fast as it comes),
checks its SHA-256 and prints the RSS over the download in the same way.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker_agent import protocol  # noqa: E402 - importable once ROOT is on the path

BLOCK = (bytes(range(256)) * 4096)  # 1 MiB, the same every time: the expected SHA-256 is computed as we send

SETUP = """
from django.utils import timezone
from artifacts.tokens import upload_token
from job_queue.models import Job, JobAttempt, JobStatus, new_lease_id
from workers.models import Worker, WorkerStatus
now = timezone.now()
worker = Worker.objects.create(name="bench", status=WorkerStatus.BUSY)
lease = new_lease_id()
job = Job.objects.create(config_name="bench", status=JobStatus.RUNNING, worker=worker, worker_name="bench",
                         lease_id=lease, attempt_count=1, dispatched_at=now, started_at=now)
JobAttempt.objects.create(job=job, number=1, lease_id=lease, worker=worker, worker_name="bench", dispatched_at=now, started_at=now)
Worker.objects.filter(pk=worker.pk).update(current_job=job)
print(upload_token(lease))
"""


class GeneratedBody:
    """A file-like body of ``size`` bytes that hashes what it hands out (requests sends its __len__ as Content-Length)."""

    def __init__(self, size):
        self.size = size
        self.sent = 0
        self.digest = hashlib.sha256()

    def __len__(self):
        return self.size - self.sent

    def read(self, n=-1):
        n = len(BLOCK) if n is None or n < 0 else min(n, len(BLOCK))
        n = min(n, self.size - self.sent)
        data = BLOCK[:n]
        self.sent += n
        self.digest.update(data)
        return data


def sample(process, samples, stop):
    while not stop.is_set():
        try:
            samples.append(process.memory_info().rss)
        except psutil.Error:
            return
        stop.wait(0.02)


def measured(process, action):
    """Run ``action()`` while sampling ``process``'s RSS; return ``(result, baseline, peak, seconds)``."""
    baseline = process.memory_info().rss
    samples, stop = [baseline], threading.Event()
    sampler = threading.Thread(target=sample, args=(process, samples, stop), daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        result = action()
    finally:
        stop.set()
        sampler.join()
    return result, baseline, max(samples), time.monotonic() - started


def download(url, token, read_mib_per_s):
    """GET ``url`` streamed, at most ``read_mib_per_s`` MiB/s (0: no limit); return ``(status, sha256, size)``."""
    digest, size = hashlib.sha256(), 0
    with requests.get(url, headers={protocol.UPLOAD_TOKEN_HEADER: token}, stream=True, timeout=3600) as response:
        started = time.monotonic()
        for chunk in response.iter_content(64 * 1024):
            digest.update(chunk)
            size += len(chunk)
            if read_mib_per_s:
                ahead = size / (read_mib_per_s * 1024 * 1024) - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        return response.status_code, digest.hexdigest(), size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--server", choices=("cli", "daphne"), default="cli")
    parser.add_argument("--port", type=int, default=8401)
    parser.add_argument("--read-mib-per-s", type=float, default=0, help="how fast the download is read (0: at once)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="upload-bench-") as data_dir:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(SIMPLETUNER_DATA_DIR=data_dir, TMPDIR=data_dir, DJANGO_SETTINGS_MODULE="simpletuner_site.settings")
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
        token = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", SETUP], cwd=ROOT, env=env, check=True, capture_output=True, text=True
        ).stdout.strip().splitlines()[-1]
        if args.server == "cli":
            argv = [sys.executable, "-m", "simpletuner_cli", "server", "--host", "127.0.0.1", "--port", str(args.port),
                    "--no-local-worker", "--no-migrate"]  # fmt: skip
        else:
            argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(args.port), "simpletuner_site.asgi:application"]
        log = open(Path(data_dir) / "server.log", "wb")
        server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{args.port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    requests.get(base + "/api/queue/", timeout=1)
                    break
                except requests.RequestException:
                    time.sleep(0.2)
            process = psutil.Process(server.pid)
            time.sleep(1.0)
            body = GeneratedBody(args.mb * 1024 * 1024)
            url = f"{base}{protocol.UPLOAD_PATH}/bench/run/model.bin"
            response, baseline, peak, took = measured(process, lambda: requests.put(
                url, data=body, headers={protocol.UPLOAD_TOKEN_HEADER: token, "Content-Type": "application/octet-stream"},
                timeout=3600,
            ))  # fmt: skip
            ok = response.status_code == 201 and response.json().get("sha256") == body.digest.hexdigest()
            time.sleep(1.0)
            got, d_baseline, d_peak, d_took = measured(process, lambda: download(url, token, args.read_mib_per_s))
            d_ok = got == (200, body.digest.hexdigest(), body.size)
        finally:
            server.terminate()
            server.wait(30)
            log.close()
        mib = 1024 * 1024
        print(f"server: {args.server}  upload: {args.mb} MiB  status: {response.status_code}  sha256 matches: {ok}")
        print(f"RSS baseline {baseline / mib:.0f} MiB, peak {peak / mib:.0f} MiB (+{(peak - baseline) / mib:.0f} MiB), "
              f"{took:.1f} s ({args.mb / took:.0f} MiB/s)")  # fmt: skip
        pace = f"read at {args.read_mib_per_s:g} MiB/s" if args.read_mib_per_s else "read at once"
        print(f"download ({pace}): status {got[0]}  sha256 matches: {d_ok}")
        print(f"RSS baseline {d_baseline / mib:.0f} MiB, peak {d_peak / mib:.0f} MiB (+{(d_peak - d_baseline) / mib:.0f} MiB), "
              f"{d_took:.1f} s ({args.mb / d_took:.0f} MiB/s)")  # fmt: skip
        return 0 if ok and d_ok else 1


if __name__ == "__main__":
    sys.exit(main())
