"""End-to-end harness for Redis: a private ``redis-server`` a test may stop and start again on its port."""

import shutil
import subprocess
from pathlib import Path

from worker_agent.runner import parent_death_signal

from .harness import START_DEADLINE_S, HarnessError, free_port, poll, stop_process

REDIS_SERVER = "redis-server"


def redis_server_binary():
    """Return the path of ``redis-server``, or None when it is not installed."""
    return shutil.which(REDIS_SERVER)


class RedisServer:
    """A ``redis-server`` of the test's own on a free port, without persistence; it keeps its port across restarts."""

    def __init__(self, data_dir, *, binary=REDIS_SERVER):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "redis.log"
        self.binary = binary
        self.port = None
        self.process = None

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        """Start the server (on its previous port after a stop, so clients find it again); wait until it answers."""
        if self.port is None:
            self.port = free_port()
        args = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.data_dir)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=parent_death_signal()
            )
        poll(self._answers, timeout=START_DEADLINE_S, message=f"redis-server on port {self.port}")
        return self

    def _answers(self):
        import redis

        if self.process.poll() is not None:
            raise HarnessError(f"redis-server exited with {self.process.returncode}\n{self.read_log()}")
        try:
            with self.client() as client:
                return client.ping()
        except (redis.ConnectionError, redis.BusyLoadingError):
            return False

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=2)

    def subscribers(self, channel):
        """Return how many connections are subscribed to ``channel`` now."""
        with self.client() as client:
            return dict(client.pubsub_numsub(channel)).get(channel.encode(), 0)

    def is_alive(self):
        return self.process is not None and self.process.poll() is None

    def stop(self):
        """Stop the server: every client sees its connection closed, and new connections are refused."""
        process, self.process = self.process, None
        stop_process(process)

    def read_log(self):
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
