"""The fleet simulator's measurements; each takes a running server's Fleet and returns a JSON-able dict."""

import asyncio
import gc
import time

import psutil
from fleet_http import Client, HTTPError
from fleet_sim import summary_ms

from worker_agent import protocol

MEASURED = {"role": "measured"}
LOST_AFTER_S = 10  # a submit not dispatched by then counts as lost in the latency figures


def server_sample(server):
    """RSS (KB, the server processes and their children), threads and DB connections of the server."""
    rss = threads = 0
    for pid in server.server_pids():
        p = psutil.Process(pid)
        for q in [p, *p.children(recursive=True)]:
            rss += q.memory_info().rss // 1024
            threads += q.num_threads()
    return {"rss_kb": rss, "threads": threads, "db_connections": server.db_connections()}


async def dispatch_latency(fleet, *, n, warmup, labels=MEASURED, submit_client=None):
    """Sequential submits: from just before the submit request to the parsed ``job_submit``; each job
    completes (running, completed) before the next submit."""
    lat, rtt, off, refused, lost = [], [], 0, 0, []
    gc.collect()
    gc.disable()  # a collection over thousands of stream objects would stall the reader mid-measurement
    try:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            job_id, elapsed = await fleet.submit(labels, client=submit_client)
            try:
                t, worker = await fleet.wait("dispatch", job_id, timeout=LOST_AFTER_S)
            except HTTPError:
                # Never dispatched (the peer has been seen to drop a submit right after it starts): counted
                # and reported, not measured, and the run goes on rather than failing.
                lost.append(job_id)
                continue
            done = await fleet.wait(protocol.COMPLETED, job_id)
            if i >= warmup:
                refused += done is None  # the server refused the worker's report (see SimWorker._refused)
                lat.append(t - t0)
                rtt.append(elapsed)
                off += worker.labels != labels
    finally:
        gc.enable()
    return {**summary_ms(lat), "submit_rtt_p50_ms": summary_ms(rtt)["p50_ms"], "off_measured": off,
            "reports_refused": refused, "lost": len(lost),
            "fleet": len(fleet.workers) - 1}


async def throughput(fleet, *, workers, duration, warm=3.0, backlog=None, submitters=8, base_urls=None):
    """Lifecycle throughput: ``workers`` instant workers, a backlog kept topped up, jobs completed per second
    over ``duration`` seconds after ``warm`` seconds, and submit-to-completed latency.

    ``base_urls``: server processes sharing one database, each given an equal share of the workers (their
    streams and every request of theirs) and of the submitters, as a balancer in front of them would."""
    labels = {"role": "throughput"}
    base_urls = base_urls or [fleet.base_url]
    made = []
    for index, url in enumerate(base_urls):
        share = workers // len(base_urls) + (index < workers % len(base_urls))
        made += await fleet.add(share, labels, prefix=f"tp{index}", base_url=url, requests_too=True)
    backlog = backlog or 2 * workers
    submitted_at = {}
    state = {"open": 0}
    done_lat = []
    t_start = time.perf_counter()
    t_end = t_start + warm + duration
    clients = [Client(url, pool=submitters) for url in base_urls]

    async def submitter(client):
        while time.perf_counter() < t_end:
            if state["open"] >= backlog:
                fleet.completed.clear()
                try:
                    await asyncio.wait_for(fleet.completed.wait(), max(0.01, t_end - time.perf_counter()))
                except asyncio.TimeoutError:
                    pass
                continue
            state["open"] += 1
            t0 = time.perf_counter()
            job_id, _ = await fleet.submit(labels, client=client)
            submitted_at[job_id] = t0
            asyncio.create_task(watch(job_id))

    async def watch(job_id):
        try:
            t = await fleet.wait(protocol.COMPLETED, job_id, timeout=warm + duration + 30)
        except HTTPError:
            t = None  # never completed: not counted

        state["open"] -= 1
        if t is not None and t_start + warm <= t <= t_end:
            done_lat.append(t - submitted_at[job_id])

    first = len(fleet.completions)
    await asyncio.gather(*(submitter(clients[i % len(clients)]) for i in range(submitters)))
    window = [t for t in fleet.completions[first:] if t_start + warm <= t <= t_end]
    for client in clients:
        client.close()
    await fleet.remove(made)
    return {"workers": workers, "processes": len(base_urls), "duration_s": duration, "jobs_completed": len(window),
            "jobs_per_s": round(len(window) / duration, 1), "backlog": backlog,
            "submit_to_completed": summary_ms(done_lat), "errors": fleet.errors,
            "reports_refused": len(fleet.refused)}


async def heartbeats(fleet, *, rate, duration):
    """Open loop: ``rate`` heartbeats a second for ``duration`` seconds, round-robin over the fleet;
    latency from each heartbeat's scheduled time to its answer (client-side queueing included)."""
    pool = [w for w in fleet.workers if w.labels.get("role") == "fleet"] or fleet.workers
    lat, failed = [], 0
    t0 = time.perf_counter()
    total = int(rate * duration)

    async def one(w, due):
        nonlocal failed
        st, _ = await w.heartbeat()
        if st == 200:
            lat.append(time.perf_counter() - due)
        else:
            failed += 1

    tasks = []
    for i in range(total):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(pool[i % len(pool)], due)))
    # answers still owed 5 s after the last was offered are given up (a server far behind would otherwise
    # hold the run for minutes): counted as unanswered, their latency at least that long
    done, pending = await asyncio.wait(tasks, timeout=5) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    elapsed = time.perf_counter() - t0
    return {"offered_per_s": rate, "answered_per_s": round(len(lat) / elapsed, 1), "failed": failed,
            "unanswered": len(pending), "over_workers": len(pool), **summary_ms(lat)}


async def idle_streams(fleet, server, *, streams, before):
    """Server memory per idle stream: RSS before the idle fleet opened vs with ``streams`` open."""
    have = sum(1 for w in fleet.workers if w.labels.get("role") == "fleet")
    if streams > have:
        await fleet.add(streams - have, {"role": "fleet"}, prefix="fleet")
    await asyncio.sleep(2)
    after = server_sample(server)
    per = (after["rss_kb"] - before["rss_kb"]) * 1024 / max(streams, 1) / 1000
    return {"streams": streams, "kb_per_stream": round(per, 1), "rss_mb": round(after["rss_kb"] / 1024, 1),
            "threads": after["threads"], "db_connections": after["db_connections"],
            "threads_before": before["threads"]}


async def failover(fleet, *, timeout):
    """A busy worker goes silent (no heartbeat, no reports, stream left open): seconds from its last
    answered heartbeat to its job's ``job_submit`` on the other worker."""
    labels = {"role": "failover"}
    pair = await fleet.add(2, labels, hold=3600, heartbeat=max(timeout / 4, 0.2), prefix="fo")
    job_id, _ = await fleet.submit(labels)
    _, first = await fleet.wait("dispatch", job_id)
    await asyncio.sleep(0.5)  # it reports running and heartbeats busy
    first.go_silent()
    silent_since = first.last_heartbeat
    fleet.futures.pop(("dispatch", job_id), None)
    t, second = await fleet.wait("dispatch", job_id, timeout=timeout * 4 + 30)
    seconds = t - silent_since
    await fleet.remove(pair)
    return {"seconds": round(seconds, 2), "heartbeat_timeout_s": timeout, "bound_s": timeout + 1,
            "other_worker": second is not first}


async def token_rotation(fleet, worker, *, via):
    """Rotate ``worker``'s token through ``via`` (another process): seconds until its stream closes."""
    t0 = time.perf_counter()
    st, _, _ = await via.request("POST", f"/api/admin/workers/{worker.id}/token", headers=fleet.admin)
    try:
        await asyncio.wait_for(worker.closed.wait(), 30)
        closed = round(time.perf_counter() - t0, 3)
    except asyncio.TimeoutError:
        closed = None
    return {"rotate_status": st, "stream_closed_after_s": closed}
