"""Stand-ins for the HTTP session, the orchestrator client, the GPU monitor and the job process."""

import json

import requests

from worker_agent import protocol
from worker_agent.client import Refused


class FakeResponse:
    def __init__(self, status=200, body=None, headers=None, reason="OK"):
        self.status_code = status
        self._body = body
        self.headers = headers or {}
        self.reason = reason
        self.closed = False

    def json(self):
        if self._body is None:
            raise ValueError("no JSON")
        return json.loads(json.dumps(self._body))

    def close(self):
        self.closed = True


class FakeSession:
    """Answers each request with the next scripted response (or raises the scripted exception)."""

    def __init__(self, *script):
        self.script = list(script)
        self.headers = {}
        self.verify = True
        self.calls = []

    def request(self, method, url, timeout=None, **kwargs):
        self.calls.append({"method": method, "url": url, "timeout": timeout, **kwargs})
        item = self.script.pop(0)
        if callable(item) and not isinstance(item, FakeResponse):
            item = item()  # e.g. a signal arriving while the request blocks
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        pass


class FakeClient:
    """The orchestrator as the agent sees it: scripted answers per call, every call recorded."""

    def __init__(self):
        self.calls = []
        self.answers = {}  # name -> list of results or exceptions (last one repeats)
        self.base_url = "http://orch:8001"
        self.verify = True

    def script(self, name, *answers):
        self.answers[name] = list(answers)

    def _answer(self, name, default):
        queue = self.answers.get(name)
        if not queue:
            return default
        item = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(item, BaseException):
            raise item
        return item

    def register(self, body):
        self.calls.append(("register", body))
        return self._answer("register", {"worker_id": "w_1", "status": "idle", "heartbeat_interval": 30})

    def heartbeat(self, body):
        self.calls.append(("heartbeat", body))
        return self._answer("heartbeat", {"status": "idle", "draining": False})

    def report(self, job_id, body):
        self.calls.append(("report", job_id, dict(body)))
        return self._answer(f"report:{body['status']}", {"accepted": True})

    def disconnect(self):
        self.calls.append(("disconnect",))
        return self._answer("disconnect", {"status": "offline"})

    def close(self):
        pass

    def stopping(self):
        self.calls.append(("stopping",))

    def interrupt(self, *, force=False):
        pass  # never inside a blocking call: the fake answers at once

    def reports(self, job_id=None):
        return [(c[1], c[2]["status"], c[2]) for c in self.calls if c[0] == "report" and job_id in (None, c[1])]

    def names(self):
        return [c[0] for c in self.calls]


def refused(job_id, code=protocol.JOB_NOT_OWNED):
    return Refused(f"job {job_id} is not yours", code=code, abandon_job=job_id)


class FakeMonitor:
    """GPUs as the agent sees them: ``slots`` are the indices jobs may be given (none: the agent runs one job at a
    time, as every test before several jobs per worker); ``use_gpus`` records --gpus."""

    def __init__(self, slots=(), declared=False):
        self._slots = list(slots)
        self.declared = declared
        self.used = None

    def capabilities(self):
        return {"gpu_count": 2, "gpu_name": "Fake GPU", "gpu_vram_gb": 80.0, "accelerator_type": "cuda", "gpus": []}

    def use_gpus(self, indices):
        self.used = list(indices)

    def slots(self):
        return list(self._slots), self.declared

    def sample(self):
        return {"cpu_percent": 12.5, "gpu_utilization": [90, 80]}

    def close(self):
        pass


class FakeRun:
    """A JobRun that never forks: the test decides when and how it ends."""

    instances = []

    def __init__(
        self, *, job_id, attempt, config, dataloader, work_dir, command, on_exit, grace, clock, transfer=None, resume=None, placement=None
    ):  # fmt: skip
        self.job_id, self.attempt, self.config, self.dataloader = job_id, attempt, config, dataloader
        self.placement = placement
        self.transfer, self.resume = transfer, resume
        self.job_dir = work_dir / job_id
        self.on_exit = on_exit
        self.returncode = None
        self.stop_reason = None
        self.started_at = self.finished_at = None
        self.progress = {}
        self.version = 0
        self.tail = []
        self.killed = False
        self.fail_start = None
        self.signals = []
        self.running = False
        FakeRun.instances.append(self)

    def start(self):
        if self.fail_start:
            raise self.fail_start
        self.started_at = 0.0
        self.running = True
        return self

    def snapshot(self):
        return dict(self.progress), self.version

    def log_tail(self):
        return "\n".join(self.tail)

    def last_line(self):
        return self.tail[-1] if self.tail else ""

    def log_chunk(self):
        """As JobRun: the lines not yet accepted by the orchestrator (all of ``tail`` from ``sent`` on)."""
        sent = getattr(self, "sent", 0)
        return {"from": sent, "lines": self.tail[sent:]} if len(self.tail) > sent else None

    def log_sent(self, chunk):
        if chunk:
            self.sent = chunk["from"] + len(chunk["lines"])

    def emit(self, line=None, **progress):
        if line:
            self.tail.append(line)
        self.progress.update(progress)
        self.version += 1

    def stop(self, reason, grace=None):
        if self.stop_reason is None:
            self.stop_reason = reason
        self.signals.append("TERM")

    def kill(self):
        self.killed = True
        self.signals.append("KILL")

    def wait(self, timeout=None):
        return True

    def exit(self, code):
        self.returncode = code
        self.running = False
        self.finished_at = 1.0
        self.on_exit(self)


def connection_refused():
    return requests.exceptions.ConnectionError("HTTPConnectionPool: Max retries exceeded ([Errno 111] Connection refused)")
