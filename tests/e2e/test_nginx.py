"""The shipped nginx config (deploy/nginx/simpletuner.conf) against Debian's nginx: it passes ``nginx -t``, and in
front of a real orchestrator it proxies the API over TLS, redirects plain HTTP, and bounds bodies per route as
the orchestrator does (1 MiB for the API; uploads up to the artifact limit, judged by the orchestrator)."""

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from simpletuner_cli.tls import ensure_self_signed_cert
from tests.services import missing_service
from worker_agent import protocol

from .harness import REPO_ROOT, free_port

pytestmark = pytest.mark.e2e

CONFIG = REPO_ROOT / "deploy" / "nginx" / "simpletuner.conf"
MiB = 1024 * 1024


def nginx_binary():
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)
    if found is None:
        missing_service("nginx is not installed (Debian's nginx package)")
    return found


def site_config(tmp, *, upstream_port, http_port, https_port):
    """The shipped config, with this test's certificate, ports and upstream: nothing else changed."""
    cert, key, _ = ensure_self_signed_cert(tmp / "tls", "127.0.0.1")
    text = CONFIG.read_text()
    replacements = {
        "/etc/letsencrypt/live/orchestrator.example.com/fullchain.pem": str(cert),
        "/etc/letsencrypt/live/orchestrator.example.com/privkey.pem": str(key),
        "    server 127.0.0.1:8001;\n    server 127.0.0.1:8002;\n": f"    server 127.0.0.1:{upstream_port};\n",
        "listen 80;": f"listen 127.0.0.1:{http_port};",
        "listen 443 ssl http2;": f"listen 127.0.0.1:{https_port} ssl http2;",
    }
    for old, new in replacements.items():
        assert old in text, f"the shipped config no longer has {old!r}: update this test"
        text = text.replace(old, new)
    site = tmp / "simpletuner.conf"
    site.write_text(text)
    temp = {name: tmp / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    main = tmp / "nginx.conf"
    main.write_text(
        f"pid {tmp / 'nginx.pid'};\nerror_log {tmp / 'error.log'};\nevents {{}}\nhttp {{\n  access_log off;\n"
        f"  client_body_temp_path {temp['body']};\n  proxy_temp_path {temp['proxy']};\n"
        f"  fastcgi_temp_path {temp['fastcgi']};\n  uwsgi_temp_path {temp['uwsgi']};\n  scgi_temp_path {temp['scgi']};\n"
        f"  include {site};\n}}\n"
    )
    return main, cert


def test_the_shipped_config_passes_nginx_t(tmp_path):
    conf, _ = site_config(tmp_path, upstream_port=free_port(), http_port=free_port(), https_port=free_port())
    result = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def proxied(orchestrator, tmp_path):
    http_port, https_port = free_port(), free_port()
    conf, cert = site_config(tmp_path, upstream_port=orchestrator.port, http_port=http_port, https_port=https_port)
    process = subprocess.Popen([nginx_binary(), "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off;"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    session = requests.Session()
    base = f"https://127.0.0.1:{https_port}"
    deadline = time.monotonic() + 20
    while True:  # nginx listens once it has read its config
        try:
            socket.create_connection(("127.0.0.1", https_port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.1)
    yield session, base, f"http://127.0.0.1:{http_port}", str(cert)
    process.terminate()
    process.wait(10)


def test_nginx_proxies_redirects_and_bounds_bodies_per_route(proxied, orchestrator):
    session, base, plain, cert = proxied
    bearer = {"Authorization": f"Bearer {orchestrator.admin_token}"}

    assert session.get(base + "/api/queue/", headers=bearer, verify=cert, timeout=10).status_code == 200
    redirect = session.get(plain + "/api/queue/", allow_redirects=False, timeout=10)
    assert redirect.status_code == 301 and redirect.headers["Location"].startswith("https://")
    # An API body over 1 MiB stops at nginx ...
    too_big = session.post(base + "/api/queue/submit", headers=bearer, data=b"x" * (MiB + 1), verify=cert, timeout=10)
    assert too_big.status_code == 413
    # ... an upload's passes it, and the orchestrator judges its token.
    upload = session.put(base + f"{protocol.UPLOAD_PATH}/b/k.bin", data=b"x" * (2 * MiB), verify=cert, timeout=30)
    assert (upload.status_code, upload.json()["code"]) == (401, protocol.NOT_AUTHENTICATED)
