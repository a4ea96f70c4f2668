"""The production stack end to end: two daphne servers sharing PostgreSQL and a private Redis that is restarted; and
every entry point (manage.py, the server, Celery) configured by one environment file (SIMPLETUNER_ENV_FILE)."""

import contextlib
import hashlib
import re
import time

import pytest

from .harness import Fleet, Orchestrator, WorkerHandle, create_database, drop_database, expect, poll
from ..services import missing_service
from .redis_harness import RedisServer, redis_server_binary
from .test_startup import EnvFileOrchestrator

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.postgres]

# redis-py (8.x) gives up reconnecting a pub/sub connection after 10 tries spaced at most ~5.3 s in all:
# django-eventstream's own Redis listener is dead by then. The outage outlasts that.
OUTAGE_S = 7
# Our listener tries again at most every 10 s (realtime.redis.RESUBSCRIBE_CAP_S); then every stream catches up.
RECOVERY_DEADLINE_S = 15
# A request that publishes while Redis is down must not wait on it for long.
REQUEST_DURING_OUTAGE_S = 3
EVENTS_CHANNEL = "events_channel"
SWEEP_RAN = re.compile(r"Task [\w.]+\[[^]]+\] succeeded")


class ProductionStack:
    """A fresh PostgreSQL database, a private redis-server, and daphne servers A and B sharing both."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.redis = None
        self.server_url = None
        self.database_url = None
        self.a = None
        self.b = None

    def start(self, postgres_url):
        self.redis = RedisServer(self.tmp_path_factory.mktemp("redis")).start()
        self.server_url = postgres_url
        self.database_url = create_database(postgres_url)
        self.a = self._server("a")
        self.b = self._server("b")
        return self

    def _server(self, name):
        server = Orchestrator(
            backend=f"postgres-{name}",
            data_dir=self.tmp_path_factory.mktemp(f"server-{name}"),
            database_url=self.database_url,
            redis_url=self.redis.url,
        )
        return server.start()

    def close(self):
        for server in (self.a, self.b):
            if server is not None:
                server.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.database_url:
            drop_database(self.server_url, self.database_url)

    @contextlib.contextmanager
    def logs_on_failure(self, node):
        """Attach what servers A and B (and Redis) logged during the block to a failing test's report."""
        offsets = {"A": self.a.log_size(), "B": self.b.log_size()}
        try:
            yield
        except BaseException:
            for name, server in (("A", self.a), ("B", self.b)):
                node.add_report_section("call", f"server {name} log", server.read_log(offsets[name]))
            node.add_report_section("call", "redis-server log", self.redis.read_log()[-10_000:])
            raise


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    holder = {"stack": None, "failure": None, "tmp_path_factory": tmp_path_factory}
    yield holder
    if holder["stack"] is not None:
        holder["stack"].close()


@pytest.fixture
def stack(production, postgres_url, redis_url):
    """The production stack (started on first use). Needs DATABASE_URL (PostgreSQL), REDIS_URL and redis-server.

    REDIS_URL only says that this environment runs Redis: the servers use a private redis-server, since
    the test stops it.
    """
    if not redis_server_binary():
        missing_service("redis-server is not installed: the production tests run a private one")
    if production["failure"] is not None:
        pytest.fail(f"the production stack failed to start earlier:\n{production['failure']}", pytrace=False)
    if production["stack"] is None:
        stack = ProductionStack(production["tmp_path_factory"])
        try:
            production["stack"] = stack.start(postgres_url)
        except Exception as exc:
            production["failure"] = f"{type(exc).__name__}: {exc}"
            stack.close()
            raise
    stack = production["stack"]
    for name, server in (("A", stack.a), ("B", stack.b)):
        if not server.is_alive():
            pytest.fail(f"server {name} is no longer running:\n{server.read_log()}", pytrace=False)
    if not stack.redis.is_alive():
        stack.redis.start()  # a test that failed while Redis was down left it stopped
    return stack


@pytest.fixture
def fleet(request, stack):
    """Workers made through server A and streams held by A; closed and taken offline afterwards."""
    fleet = Fleet(stack.a, request.node.originalname.removeprefix("test_").replace("_", "-"))
    yield fleet
    fleet.cleanup()


def via(worker, server):
    """Return ``worker``'s handle speaking to ``server`` instead of the one it was made on."""
    handle = WorkerHandle(server, worker.created)
    handle.token = worker.token
    return handle


def submit(server, pool, config_name):
    """Submit a job for the workers labelled ``pool`` through ``server``; return the answer."""
    body = {"config_name": config_name, "worker_labels": pool}
    return expect(server.admin("POST", "/api/queue/submit", json=body), 201)


def job_event(stream, job_id, *, timeout):
    """Return the ``job_submit`` of ``job_id`` arriving on ``stream`` within ``timeout`` s."""
    return stream.wait_for("job_submit", timeout=timeout, where=lambda e: e.json().get("job_id") == job_id)


def complete(worker, job_id, attempt):
    for reported in ("starting", "completed"):
        worker.report(job_id, reported, attempt=attempt)


def test_two_servers_serve_one_fleet(request, stack, fleet):
    a, b = stack.a, stack.b
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    on_b = via(worker, b)
    with stack.logs_on_failure(request.node):
        assert on_b.register()["status"] == "idle"
        stream = fleet.open_stream(worker)  # held by server A

        submitted = submit(b, pool, "e2e-two-servers")
        assert (submitted["dispatched"], submitted["worker_id"]) == (True, worker.id)
        job_id = submitted["job_id"]
        data = job_event(stream, job_id, timeout=10).json()
        assert (data["type"], data["config_name"]) == ("job_submit", "e2e-two-servers")

        for reported, expected in (("starting", "running"), ("running", "running"), ("completed", "completed")):
            answer = on_b.report(job_id, reported, attempt=data["attempt"])
            assert answer == {"job_id": job_id, "status": expected, "accepted": True}
            assert a.job(job_id)["status"] == expected  # reported through B, read through A
        assert (worker.state()["status"], worker.state()["current_job_id"]) == ("idle", None)

        rotated = expect(b.admin("POST", f"/api/admin/workers/{worker.id}/token"), 200)
        assert rotated["token"] != worker.token
        assert stream.wait_closed() == "server closed the stream"
        assert [e.json() for e in stream.received("shutdown")] == [{"type": "shutdown", "reason": "token rotated", "code": "token_revoked"}]
        expect(a.as_worker(worker.token, "POST", "/api/workers/heartbeat", json={"worker_id": worker.id}), 401)


def test_open_streams_survive_a_redis_restart(request, stack, fleet):
    a, b, redis = stack.a, stack.b, stack.redis
    pools = {name: {"pool": f"{fleet.tag}-{name}"} for name in ("late", "early", "rotated")}
    # late: its job is submitted after Redis is back; early: while Redis is down; rotated: its token
    # is rotated while Redis is down, so the revocation reaches server A through no pub/sub.
    workers = {name: fleet.create_worker(labels=pool) for name, pool in pools.items()}
    on_b = {name: via(worker, b) for name, worker in workers.items()}
    a_log = a.log_size()
    with stack.logs_on_failure(request.node):
        for worker in on_b.values():
            worker.register()
        streams = {name: fleet.open_stream(worker) for name, worker in workers.items()}  # held by server A

        # Before the outage: B's dispatch reaches the stream on A, so A's Redis subscriber is up.
        warmup = submit(b, pools["late"], "e2e-before-outage")
        event = job_event(streams["late"], warmup["job_id"], timeout=10)
        complete(on_b["late"], warmup["job_id"], event.json()["attempt"])
        assert redis.subscribers(EVENTS_CHANNEL) >= 1

        redis.stop()
        down_at = time.monotonic()
        started = time.monotonic()
        early = submit(b, pools["early"], "e2e-during-outage")
        took = time.monotonic() - started
        assert (early["dispatched"], early["worker_id"]) == (True, workers["early"].id)
        assert took < REQUEST_DURING_OUTAGE_S, f"a submit waited {took:.1f}s on Redis being down"
        started = time.monotonic()
        expect(b.admin("POST", f"/api/admin/workers/{workers['rotated'].id}/token"), 200)
        took = time.monotonic() - started
        assert took < REQUEST_DURING_OUTAGE_S, f"a token rotation waited {took:.1f}s on Redis being down"
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))  # the outage itself, not a wait for a result
        redis.start()

        # Redis is back on the same port: a job submitted through B reaches the stream A held all along.
        late = submit(b, pools["late"], "e2e-after-outage")
        assert (late["dispatched"], late["worker_id"]) == (True, workers["late"].id)
        late_event = job_event(streams["late"], late["job_id"], timeout=RECOVERY_DEADLINE_S)
        # What was published while Redis was down arrives too: the dispatch, and the revocation.
        early_event = job_event(streams["early"], early["job_id"], timeout=RECOVERY_DEADLINE_S)
        shutdown = streams["rotated"].wait_for("shutdown", timeout=RECOVERY_DEADLINE_S)
        assert shutdown.json() == {"type": "shutdown", "reason": "token revoked", "code": "token_revoked"}
        assert streams["rotated"].wait_closed() == "server closed the stream"
        assert not streams["rotated"].received("job_submit")

        # And pushes flow live again.
        complete(on_b["late"], late["job_id"], late_event.json()["attempt"])
        complete(on_b["early"], early["job_id"], early_event.json()["attempt"])
        again = submit(b, pools["late"], "e2e-live-again")
        job_event(streams["late"], again["job_id"], timeout=10)
        assert a.job(again["job_id"])["status"] == "dispatched"

        log = a.read_log(a_log)
        assert "Redis event listener lost" in log and "Redis event listener reconnected" in log


def test_one_env_file_names_the_database_and_redis_of_manage_py_the_server_and_celery(tmp_path, postgres_url, redis_url):
    """Issue 32.1: a token made with SIMPLETUNER_ENV_FILE=... manage.py create_api_token lands in the file's PostgreSQL
    database, which the server (and Celery, on the file's Redis) use too: nothing but the file names them."""
    import psycopg

    database_url = create_database(postgres_url)
    server = EnvFileOrchestrator(
        backend="postgres-env-file",
        data_dir=tmp_path / "data",
        env_file=tmp_path / "orchestrator.env",
        database_url=database_url,
        redis_url=redis_url,
        via_cli=True,
        celery=True,
    )
    try:
        server.write_env_file().start()  # manage.py migrate + create_api_token, the server, Celery worker and beat
        assert server.admin("GET", "/api/queue/").status_code == 200
        with psycopg.connect(database_url) as conn:
            digest = hashlib.sha256(server.admin_token.encode()).hexdigest()
            assert conn.execute("SELECT count(*) FROM workers_token WHERE digest = %s", [digest]).fetchone() == (1,)
        # a sweep Celery beat handed out through the file's Redis ran on the file's database
        poll(lambda: SWEEP_RAN.search(server.read_celery_log()), timeout=30, message="a sweep to run in Celery")
        log, celery_log = server.read_log(), server.read_celery_log()
    finally:
        server.stop()
        drop_database(postgres_url, database_url)
    assert f"  Env file     {tmp_path / 'orchestrator.env'}" in log
    assert f"  Database     postgresql {database_url}" in log
    host_and_db = redis_url.split("@")[-1].removeprefix("redis://")
    assert f"Connected to redis://:**@{host_and_db}" in celery_log or f"Connected to redis://{host_and_db}" in celery_log
