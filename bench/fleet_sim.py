"""Simulated workers speaking the worker protocol over real HTTP: register, hold the stream, heartbeat, run jobs."""

import asyncio
import math
import random
import time
from urllib.parse import urlsplit

from fleet_http import Client, HTTPError, Stream

from worker_agent import protocol


def pct(values, p):
    """The p-th percentile (nearest rank) of ``values``, or None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[max(1, math.ceil(p / 100 * len(s))) - 1]


def summary_ms(seconds):
    """p50/p99/max (and n) in milliseconds of a list of durations in seconds."""
    if not seconds:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(seconds), "p50_ms": round(pct(seconds, 50) * 1000, 2),
            "p99_ms": round(pct(seconds, 99) * 1000, 2), "max_ms": round(max(seconds) * 1000, 2)}


def job_id_of(body):
    if not isinstance(body, dict):
        return None
    return body.get("job_id") or body.get("id") or (body.get("job") or {}).get("id")


class SimWorker:
    """One simulated agent. ``hold``: seconds a job runs before its completion report (0: at once)."""

    def __init__(self, fleet, name, labels, hold=0.0, client=None):
        self.fleet, self.name, self.labels, self.hold = fleet, name, labels, hold
        self.client = client or fleet.client  # every request of this worker's goes to that client's server
        self.id = self.token = None
        self.stream = None
        self.silent = False
        self.current = None
        self.last_heartbeat = None
        self.closed = asyncio.Event()
        self._tasks = []

    @property
    def headers(self):
        return {protocol.WORKER_TOKEN_HEADER: self.token}

    async def create(self):
        c = self.client
        st, body, _ = await c.request("POST", "/api/admin/workers", headers=self.fleet.admin,
                                      json_body={"name": self.name, "worker_type": protocol.WORKER_PERSISTENT, "labels": self.labels})
        if st not in (200, 201):
            raise HTTPError(f"create worker: {st} {body}")
        self.id, self.token = body["worker_id"], body["token"]
        st, body, _ = await c.request("POST", protocol.REGISTER_PATH, headers=self.headers, json_body={
            "name": self.name, "persistent": True,
            "gpu_info": {"name": "FakeGPU", "vram_gb": 80, "count": 1, "accelerator": "cuda"},
            "gpu_count": 1, "gpu_name": "FakeGPU", "gpu_vram_gb": 80, "accelerator_type": "cuda"})
        if st != 200:
            raise HTTPError(f"register: {st} {body}")
        url = body.get("sse_url") or f"{protocol.STREAM_PATH}?worker_id={self.id}"
        parts = urlsplit(url)
        self.stream_path = parts.path + (f"?{parts.query}" if parts.query else "")
        self.last_heartbeat = time.perf_counter()

    async def connect(self, base_url=None):
        self.stream = Stream(base_url or self.fleet.base_url, self.stream_path, self.headers)
        st = await self.stream.open()
        if st != 200:
            raise HTTPError(f"stream {self.name}: {st}")
        self._tasks.append(asyncio.create_task(self._read()))

    def start_heartbeats(self, interval):
        self._tasks.append(asyncio.create_task(self._beat(interval)))

    async def _read(self):
        async for event, data in self.stream.events():
            if not isinstance(data, dict) or self.silent:
                continue
            if data.get("type") == protocol.JOB_SUBMIT or event == protocol.JOB_SUBMIT:
                self.fleet.on_dispatch(self, data, time.perf_counter())
                self._tasks.append(asyncio.create_task(self._run(data)))
        self.closed.set()

    async def _beat(self, interval):
        await asyncio.sleep(random.uniform(0, interval))
        while not self.silent:
            await self.heartbeat()
            await asyncio.sleep(interval)

    async def heartbeat(self):
        body = {"worker_id": self.id, "status": protocol.AGENT_BUSY if self.current else protocol.AGENT_IDLE,
                "current_job_id": self.current}
        st, _, elapsed = await self.client.request("POST", protocol.HEARTBEAT_PATH, headers=self.headers,
                                                         json_body=body)
        if st == 200:
            self.last_heartbeat = time.perf_counter()
        return st, elapsed

    async def report(self, job_id, status, attempt):
        body = {"status": status}
        if attempt:
            body["attempt"] = attempt
        st, _, _ = await self.client.request("POST", protocol.job_status_path(job_id), headers=self.headers,
                                                   json_body=body)
        return st

    async def _run(self, job):
        job_id, attempt = job.get("job_id"), job.get("attempt")
        self.current = job_id
        try:
            st = await self.report(job_id, protocol.RUNNING, attempt)
            if st != 200:
                return await self._refused(job_id, protocol.RUNNING, st)
            if self.silent:
                return
            if self.hold:
                await asyncio.sleep(self.hold)
            if self.silent:
                return
            st = await self.report(job_id, protocol.COMPLETED, attempt)
            if st == 200:
                self.fleet.on_completed(self, job_id, time.perf_counter())
            else:
                await self._refused(job_id, protocol.COMPLETED, st)
        except HTTPError:
            self.fleet.errors += 1
        finally:
            self.current = None

    async def _refused(self, job_id, status, http_status):
        """A report answered other than 200: the job is not this worker's (a server that sent one job to two
        workers refuses the one it did not record). Counted; the worker says it is idle again."""
        self.current = None
        self.fleet.on_refused(job_id, status, http_status)
        await self.heartbeat()

    def go_silent(self):
        """Stop heartbeating and answering, keeping the TCP stream open (a machine that hung)."""
        self.silent = True

    def close(self):
        for t in self._tasks:
            t.cancel()
        if self.stream:
            self.stream.close()


class Fleet:
    """The simulated agents of one run against one server, with what they saw keyed by job id."""

    def __init__(self, server, base_url=None, pool=256):
        self.server = server
        self.base_url = base_url or server.url
        self.client = Client(self.base_url, pool=pool)
        self._pool = pool
        self._clients = {self.base_url: self.client}
        self.admin = server.admin_headers()
        self.workers = []
        self.futures = {}
        self.dispatches = {}
        self.completions = []
        self.errors = 0
        self.refused = []  # (job id, status reported, HTTP status) of reports not answered 200
        self.tag = f"{int(time.time() * 1000) % 10_000_000}"
        self.completed = asyncio.Event()

    def _future(self, key):
        fut = self.futures.get(key)
        if fut is None:
            fut = self.futures[key] = asyncio.get_running_loop().create_future()
        return fut

    async def wait(self, kind, job_id, timeout=30):
        fut = self._future((kind, job_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            refused = [r for r in self.refused if r[0] == job_id]
            raise HTTPError(f"no {kind} of job {job_id} within {timeout} s; reports refused: {refused}") from None
        finally:
            self.futures.pop((kind, job_id), None)

    def on_dispatch(self, worker, job, t):
        job_id = job.get("job_id")
        self.dispatches[job_id] = (t, worker)
        fut = self._future(("dispatch", job_id))
        if not fut.done():
            fut.set_result((t, worker))

    def on_completed(self, worker, job_id, t):
        self.completions.append(t)
        self.completed.set()
        fut = self._future((protocol.COMPLETED, job_id))
        if not fut.done():
            fut.set_result(t)

    def on_refused(self, job_id, status, http_status):
        self.refused.append((job_id, status, http_status))
        fut = self._future((protocol.COMPLETED, job_id))
        if not fut.done():
            fut.set_result(None)

    def client_for(self, base_url=None):
        """The client of the server at ``base_url`` (this fleet's own by default), made on first use."""
        base_url = (base_url or self.base_url).rstrip("/")
        if base_url not in self._clients:
            self._clients[base_url] = Client(base_url, pool=self._pool)
        return self._clients[base_url]

    async def add(self, count, labels, *, hold=0.0, heartbeat=30.0, concurrency=32, prefix="w", base_url=None,
                  requests_too=False):
        """Create, register and connect ``count`` workers (``concurrency`` at a time); return them.

        ``base_url``: their streams go to that server instead of this fleet's; with ``requests_too`` their
        registration, heartbeats and reports go there as well (a process behind a balancer, all the way).
        """
        start = len(self.workers)
        client = self.client_for(base_url) if requests_too else None
        made = [SimWorker(self, f"{prefix}-{self.tag}-{start + i}", labels, hold, client) for i in range(count)]
        gate = asyncio.Semaphore(concurrency)

        async def one(w):
            async with gate:
                await w.create()
                await w.connect(base_url)
                if heartbeat:
                    w.start_heartbeats(heartbeat)

        await asyncio.gather(*(one(w) for w in made))
        self.workers.extend(made)
        return made

    async def remove(self, workers):
        """Close the workers' streams and delete them from the server (the peer dispatches to idle stale ones)."""
        for w in workers:
            w.close()
        gate = asyncio.Semaphore(16)

        async def delete(w):
            async with gate:
                await self.client.request("DELETE", f"/api/admin/workers/{w.id}?force=true", headers=self.admin)

        await asyncio.gather(*(delete(w) for w in workers))
        gone = set(map(id, workers))
        self.workers = [w for w in self.workers if id(w) not in gone]

    async def submit(self, labels, client=None):
        """Submit one no-op job routed by ``labels``; return (job id, seconds the request took)."""
        st, body, elapsed = await (client or self.client).request("POST", "/api/queue/submit", headers=self.admin,
                                                                  json_body={"config_name": "bench", "target": "worker",
                                                                             "worker_labels": labels})
        job_id = job_id_of(body)
        if st >= 400 or not job_id:
            raise HTTPError(f"submit: {st} {body}")
        return job_id, elapsed

    def close(self):
        for w in self.workers:
            w.close()
        for client in self._clients.values():
            client.close()
