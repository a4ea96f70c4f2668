"""How the example trainer publishes its checkpoints, as SimpleTuner's trainer does: standard library only.

With ``SIMPLETUNER_UPLOAD_ENDPOINT`` and ``SIMPLETUNER_UPLOAD_TOKEN`` set (the agent sets both), each file
of a checkpoint directory is PUT to ``{endpoint}/output/checkpoint-<step>/<file>`` with the token in
``X-Upload-Token``, then the checkpoint is declared complete. A failure is reported and training goes on:
the agent uploads the whole output directory when the trainer ends.
"""

import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from . import protocol

TIMEOUT = 10
TRIES = 2  # training waits while a checkpoint is published: an unreachable orchestrator costs it about a second


class PublishError(Exception):
    """A checkpoint could not be published."""


class Publisher:
    def __init__(self, endpoint, token, *, opener=urllib.request.urlopen, sleep=time.sleep, tries=TRIES):
        self.endpoint = endpoint.rstrip("/")
        self.token = token
        self._open = opener
        self._sleep = sleep
        self._tries = tries

    @classmethod
    def from_environment(cls, environ=None):
        """Return a Publisher for the endpoint and token the agent passed, or None when it passed none."""
        environ = os.environ if environ is None else environ
        endpoint, token = environ.get(protocol.UPLOAD_ENDPOINT_ENV), environ.get(protocol.UPLOAD_TOKEN_ENV)
        return cls(endpoint, token) if endpoint and token else None

    def _send(self, method, url, data=None):
        for attempt in range(1, self._tries + 1):
            request = urllib.request.Request(url, data=data, method=method)
            request.add_header(protocol.UPLOAD_TOKEN_HEADER, self.token)
            request.add_header("Content-Type", "application/octet-stream")
            try:
                with self._open(request, timeout=TIMEOUT) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                if exc.code < 500 and exc.code != 429:
                    raise PublishError(f"{method} {url}: HTTP {exc.code}") from None
                reason = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                reason = str(getattr(exc, "reason", exc))
            if attempt == self._tries:
                raise PublishError(f"{method} {url}: {reason}")
            self._sleep(0.5 * attempt)
        return None

    def publish_checkpoint(self, directory, step):
        """PUT every file of checkpoint directory ``directory`` (of ``step``), then declare it complete."""
        directory = Path(directory)
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            key = f"{directory.name}/{path.relative_to(directory).as_posix()}"
            self._send("PUT", f"{self.endpoint}/output/{quote(key)}", path.read_bytes())
        if self.endpoint.endswith(protocol.UPLOAD_PATH):
            root = self.endpoint[: -len(protocol.UPLOAD_PATH)]
            self._send("POST", root + protocol.checkpoint_complete_path(step), b"")
