"""Everything that replaces or patches how the frameworks serve HTTP: daphne, Twisted, Django's ASGI handler.

The rest of the project is served by Django, DRF, daphne and django-eventstream as they come. What is here exists
because a measured figure needed it; ``serving/tests/test_canaries.py`` fails when the framework code a piece
copies or patches changes, so an upgrade is re-checked here, not found in production. Checked against Django
5.2, daphne 4.2, Twisted 26.10 and django-eventstream 5.3 (the pins of requirements.txt). Three pieces on
framework internals live with what they serve, their canaries here too: the ORM reads compiled once
(``common.prepared``), the stream registry on django-eventstream (``realtime.listeners``) and the SQLite
backend's transaction lock (``common.db.sqlite3``).

A fast path stays only while it moves a figure that has a target (issue 13's, ``docs/benchmarks.md``) by at
least 10%; each names its figure below. ``SIMPLETUNER_FAST_PATHS=off`` (``settings.FAST_PATHS``) turns off
every piece marked *fast path*: every request then goes through Django's own ``ASGIHandler`` and DRF, and
daphne parses and collects as it comes. CI runs the protocol and end-to-end tests with it off, so each fast
path is shown to answer as the plain route does. The pieces marked *bound* stay on whatever the switch: they
bound the server's memory and disk.

- ``asgi.PooledASGIHandler`` (fast path) replaces Django's per-request thread (its ThreadSensitiveContext)
  and its async-mode middleware chain with a sync chain on ``SIMPLETUNER_REQUEST_THREADS`` long-lived
  threads, artifact transfers on ``SIMPLETUNER_TRANSFER_THREADS`` threads of their own and sign-ins (their
  password hashing) on two more. Bought: a new thread per request was 21% of the server's samples; 8 threads against 20 on PostgreSQL, 3-31% more
  lifecycle throughput (``bench/fleet.py --only throughput``; target: 1.25x the peer's); a slow S3 transfer
  never holds a thread a heartbeat waits for. Django's ``handle`` is used as it is.
- ``asgi.StreamASGIHandler`` (fast path) runs the SSE streams without Django's per-request thread: an endless
  response would hold a thread and a DB connection each (``bench/stream_cost.py``: 214 -> ~35 KB per idle
  stream, 1 thread per stream -> a few in all; target: no thread per stream).
- ``heartbeat.HeartbeatEndpoint`` (fast path) answers a heartbeat that changes no state below Django and
  records such heartbeats in batches (``job_queue.agents.worker_heartbeats_liveness``, the one rule of a
  plain heartbeat). Bought: 1.9 ms -> 65 µs per heartbeat; at 1,000 heartbeats/s 266 -> 977 answered/s on
  SQLite and 169 -> 991 on PostgreSQL (``bench/fleet.py --only heartbeats``; target: 1,000/s absorbed with
  p99 <= 50 ms).
- ``streams.WorkerStreamEndpoint`` (fast path) opens a plain, valid worker stream without Django's request
  objects: 39.2 -> 25.9 KB per idle stream at 10,000 streams (``bench/stream_cost.py``; target: <= 30 KB).
- ``lean`` holds what those two endpoints share: the request's headers read as Django reads them, the
  security headers Django's middleware adds (held to the middleware by ``serving/tests/test_lean.py`` on every
  route), and the replay of what was read to the fallback handler.
- ``daphne.GuardedRequest`` with ``guard`` (bound) judges a request from its head before its body is read (a route's
  body limit, the token a route with a body needs, the spool bound of all bodies together) and holds a body to
  them as it arrives: daphne and Twisted spool a whole body to disk before the application sees a byte, so a
  tokenless client could fill the disk (``tests/e2e/test_body_guard.py``).
- ``daphne.SpooledBodyQueue`` (bound) replaces daphne's unbounded input queue with reads from its spool
  file: a 1 GiB upload +1 GiB -> +5 MiB of memory (``bench/upload_memory.py``).
- ``daphne.transport_drained`` (bound) waits while Twisted has paused a connection for a full send buffer: a
  slow download +420 MiB -> +5 MiB (``bench/upload_memory.py``).
- ``daphne.SpooledBodyServer.protocol_connected`` (fast path) turns off Twisted's form parsing
  (``Request._parsePOSTFormSubmission``), a quarter of the event loop's time under small POSTs (the
  heartbeats' target above).
- ``daphne.tune_gc`` (fast path) freezes the start-up heap and raises the collector's thresholds: full
  collections of ~300 ms with 1,000 streams set the heartbeats' p99 (their target above).
"""
