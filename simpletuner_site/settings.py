"""Settings for the SimpleTuner orchestrator, driven entirely by environment variables (see docs/configuration.md)."""

import hashlib
import hmac
import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlparse

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from worker_agent import protocol

from .env import LOOPBACK_ALLOWED_HOSTS, default_allowed_hosts  # noqa: F401  (the loopback names: tests read them)
from .env import env_bool as _env_bool
from .env import env_choice as _env_choice
from .env import env_int as _env_int
from .env import env_port_range as _env_port_range
from .env import env_rate as _env_rate
from .env import env_seconds as _env_seconds
from .env import load_env_file

BASE_DIR = Path(__file__).resolve().parent.parent

# The environment file named by SIMPLETUNER_ENV_FILE (the process environment wins over it). manage.py, `simpletuner
# server` and Celery load it first thing; this covers any other entry point (an ASGI server given asgi.py).
ENV_FILE = load_env_file()


DATA_DIR = Path(os.environ.get("SIMPLETUNER_DATA_DIR") or "./var").resolve()
DATA_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
# The data directory holds the SQLite database, the secret key and the TLS key: its owner only.
if DATA_DIR.stat().st_mode & 0o077 and DATA_DIR.stat().st_uid == os.getuid():
    DATA_DIR.chmod(0o700)

# Production mode: refuses to start with an example or weak secret key or without ALLOWED_HOSTS, and
# turns on the HTTPS-only settings (`manage.py check --deploy` is clean). See docs/security.md.
PRODUCTION = _env_bool("SIMPLETUNER_PRODUCTION", False)
EXAMPLE_SECRET_KEYS = {"CHANGE-ME", "change-me", "changeme", "secret", "django-insecure"}


def _secret_key():
    key = os.environ.get("DJANGO_SECRET_KEY")
    if PRODUCTION:
        if not key:
            raise ImproperlyConfigured("production mode needs DJANGO_SECRET_KEY (the same on every server)")
        # Django's own bar (security.W009): at least 50 characters, 5 distinct, not an example.
        if key.strip() in EXAMPLE_SECRET_KEYS or key.startswith("django-insecure-") or len(key) < 50 or len(set(key)) < 5:
            raise ImproperlyConfigured(
                "DJANGO_SECRET_KEY is an example or too weak for production mode: use 50 or more random "
                "characters, e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))'"
            )
    if key:
        return key
    path = DATA_DIR / "secret_key"
    if path.exists():
        return path.read_text().strip()
    key = secrets.token_urlsafe(50)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key)
    return key


SECRET_KEY = _secret_key()
# The key of the audit chain's HMAC (audit.chain). Rows verify only with the key they were written with.
SIMPLETUNER_AUDIT_KEY = os.environ.get("SIMPLETUNER_AUDIT_KEY") or hmac.new(
    SECRET_KEY.encode(), b"simpletuner.audit-chain.v1", hashlib.sha256
).hexdigest()
DEBUG = _env_bool("DJANGO_DEBUG", False)

if os.environ.get("DJANGO_ALLOWED_HOSTS", "").strip() or PRODUCTION:
    ALLOWED_HOSTS = [h.strip() for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "").split(",") if h.strip()]
else:
    ALLOWED_HOSTS = default_allowed_hosts()
if PRODUCTION and (not ALLOWED_HOSTS or "*" in ALLOWED_HOSTS):
    raise ImproperlyConfigured(
        "production mode needs DJANGO_ALLOWED_HOSTS: the host names this orchestrator answers to "
        "(comma-separated, no '*'): requests for any other Host are refused"
    )
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

INSTALLED_APPS = [
    "daphne",
    "simpletuner_site.apps.OrchestratorAdminConfig",  # django.contrib.admin with the fleet overview
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_eventstream",
    # Ours, bottom layer first (the import-linter contract in .importlinter enforces the order).
    "audit",
    "workers",
    "artifacts",
    "training_configs",
    "tenancy",
    "job_queue",
    "realtime",
    "observability",
    "webhooks",
    "simpletuner_site.apps.SiteConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "common.middleware.APINoStoreMiddleware",
    "common.middleware.AdminQueryTextMiddleware",
    "common.middleware.ApiErrorsAsJsonMiddleware",  # sees every response from the layers below (NoStore marks its own)
    "common.middleware.StaticFilesMiddleware",  # WhiteNoise, async-capable: no thread hop per request
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "simpletuner_site.urls"
ASGI_APPLICATION = "simpletuner_site.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "simpletuner_site" / "templates"],  # the admin's overrides
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
DATABASE_URL = os.environ.get("DATABASE_URL", "")
# PostgreSQL connections per server process kept open and shared by its requests (psycopg's pool, through
# Django's native support): a request borrows one and gives it back when it ends, instead of opening
# one (4-5 ms) per request. 0: no pool, a new connection per request.
DB_POOL_SIZE = _env_int("SIMPLETUNER_DB_POOL_SIZE", 20, minimum=0, maximum=1000)
# PostgreSQL: the runs of one statement on a connection after which psycopg prepares it on the server. 0:
# never, and parameters spliced into the statement's text by psycopg (Django's default; what a pooler
# in transaction mode, such as PgBouncer before 1.21, needs).
DB_PREPARE_THRESHOLD = _env_int("SIMPLETUNER_DB_PREPARE_THRESHOLD", 2, minimum=0, maximum=1000)
if DATABASE_URL:
    try:
        DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)}
    except Exception as exc:  # dj-database-url raises a handful of types for a bad URL
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from None
    if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
        DATABASES["default"]["ENGINE"] = "common.db.sqlite3"  # this process's transactions queued on a lock, as below
    if DB_POOL_SIZE and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # Each checkout is health-checked (CONN_HEALTH_CHECKS), so a connection PostgreSQL dropped is
        # replaced rather than handed to a request. A request waits up to 30 s for a free connection.
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": min(2, DB_POOL_SIZE), "max_size": DB_POOL_SIZE, "timeout": 30,
        }
    if DB_PREPARE_THRESHOLD and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # Parameters bound by the server (not spliced into the text by psycopg), and a statement run this
        # many times on a connection prepared there: parsed and planned once per connection, not per run.
        DATABASES["default"].setdefault("OPTIONS", {}).update(
            server_side_binding=True, prepare_threshold=DB_PREPARE_THRESHOLD
        )
else:
    DATABASES = {
        "default": {
            # Django's SQLite backend, this process's transactions queued on a lock (common/db/sqlite3)
            "ENGINE": "common.db.sqlite3",
            "NAME": str(DATA_DIR / "orchestrator.sqlite3"),
            "OPTIONS": {
                # WAL lets readers (streams, list views) proceed while one writer commits;
                # IMMEDIATE takes the write lock at BEGIN, so two writers queue instead of deadlocking.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# The serving package's fast paths (serving/__init__.py lists them): on by default; "off" serves every request
# through Django's own ASGI handler and daphne as it comes, to tell a fast path's fault from the application's.
FAST_PATHS = _env_bool("SIMPLETUNER_FAST_PATHS", True)
# Threads per server process running requests (everything but the streams; serving.asgi). They
# live as long as the process, so each keeps its database connection: SQLite's for CONN_MAX_AGE seconds;
# PostgreSQL's goes back to the pool after each request. SQLite takes one writer at a time, so more
# threads there only wait on its lock. On PostgreSQL a few more than the process's one core of Python
# (the GIL) keep it busy while some wait on the database; as many as the pool's 20 only traded the GIL
# among themselves: lifecycle throughput 3-31% lower with 20 than with 8 (docs/benchmarks.md).
_SQLITE = DATABASES["default"]["ENGINE"].endswith("sqlite3")
_POSTGRES_REQUEST_THREADS = 8
REQUEST_THREADS = _env_int(
    "SIMPLETUNER_REQUEST_THREADS",
    4 if _SQLITE else min(DB_POOL_SIZE, _POSTGRES_REQUEST_THREADS) or _POSTGRES_REQUEST_THREADS,
    minimum=1,
    maximum=1000,
)
# Threads per server process running artifact transfers (an attempt's uploads and downloads, the operators'
# artifact downloads): a body on its way to or from storage (S3: as long as the network takes) holds one
# of these, never one of the request threads that heartbeats and reports need.
TRANSFER_THREADS = _env_int("SIMPLETUNER_TRANSFER_THREADS", 16, minimum=1, maximum=1000)
if _SQLITE:
    DATABASES["default"]["CONN_MAX_AGE"] = 600
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

# --- Redis: cross-process event delivery and the Celery broker ------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    _redis = urlparse(REDIS_URL)
    if _redis.scheme not in {"redis", "rediss"} or not _redis.hostname:
        raise ImproperlyConfigured(f"REDIS_URL must look like redis://host:6379/0, got {REDIS_URL!r}")
    EVENTSTREAM_REDIS = {
        "host": _redis.hostname,
        "port": _redis.port or 6379,
        "db": int((_redis.path or "/0").lstrip("/") or 0),
        "password": _redis.password,
        "ssl": _redis.scheme == "rediss",
    }
    CELERY_BROKER_URL = REDIS_URL
    # The cache holds only the failed-authentication counters (workers.throttling): in Redis they are
    # shared by every server process. A Redis outage makes each process count on its own meanwhile.
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "simpletuner",
            "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
        }
    }
else:
    CELERY_BROKER_URL = "memory://"
    # Embedded mode: one process, so its own memory holds the failed-authentication counters.
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "simpletuner"}}
CELERY_TASK_IGNORE_RESULT = True

EVENTSTREAM_STORAGE_CLASS = "realtime.storage.EventStorage"  # the library's tables, written in our transaction
EVENTSTREAM_CHANNELMANAGER_CLASS = "realtime.listeners.WorkerChannelManager"
EVENTSTREAM_ALLOW_ORIGINS = []

# --- Orchestrator timers and policy ---------------------------------------------------------
_WORKER_NAME_MAX_LENGTH = 128  # Worker.name


def _local_worker_name():
    raw = os.environ.get("SIMPLETUNER_LOCAL_WORKER_NAME", "").strip()
    if not raw:
        return f"local@{socket.gethostname()}"[:_WORKER_NAME_MAX_LENGTH]
    if len(raw) > _WORKER_NAME_MAX_LENGTH:
        raise ImproperlyConfigured(
            f"SIMPLETUNER_LOCAL_WORKER_NAME must be at most {_WORKER_NAME_MAX_LENGTH} characters, got {len(raw)}"
        )
    return raw


SIMPLETUNER = {
    "HEARTBEAT_INTERVAL": _env_seconds("SIMPLETUNER_HEARTBEAT_INTERVAL", 30),
    "HEARTBEAT_TIMEOUT": _env_seconds("SIMPLETUNER_HEARTBEAT_TIMEOUT", 120),
    "HEALTH_CHECK_INTERVAL": _env_seconds("SIMPLETUNER_HEALTH_CHECK_INTERVAL", 60),
    # An agent acknowledges a job_submit with `starting` within milliseconds and a reconnecting stream
    # redelivers it, so a dispatch still unacknowledged after this long was lost in transit: requeue it.
    "DISPATCH_ACK_TIMEOUT": _env_seconds("SIMPLETUNER_DISPATCH_ACK_TIMEOUT", 60),
    "EPHEMERAL_CLEANUP_AFTER": _env_seconds("SIMPLETUNER_EPHEMERAL_CLEANUP_AFTER", 3600),
    "JOB_MAX_RETRIES": _env_int("SIMPLETUNER_JOB_MAX_RETRIES", 3, minimum=0, maximum=100),
    # The ports a multi-node job's rank 0 listens on for its other members (job_queue.gangs): the orchestrator
    # assigns one at each dispatch, so every member's job_submit carries it at once (no round trip to rank 0's agent
    # before the members start); one another live gang holds on the same worker is never given, and an agent that
    # finds it taken on its host refuses the job, which goes out again with another (docs/operator-guide.md).
    "GANG_PORT_RANGE": _env_port_range("SIMPLETUNER_GANG_PORT_RANGE", "29500-29999"),
    # The whole output of each attempt of a job is kept up to this many characters (the oldest go first, and
    # the log says how much went); job_queue.logs.
    "JOB_LOG_MAX_CHARS": _env_int("SIMPLETUNER_JOB_LOG_MAX_CHARS", 2_000_000, minimum=16 * 1024, maximum=200_000_000),
    # The built-in local worker that `simpletuner server` starts (see simpletuner_cli.local_worker).
    "LOCAL_WORKER_NAME": _local_worker_name(),
    # Who may read /metrics: operators (API token or session), public (no auth), off (404).
    "METRICS": _env_choice("SIMPLETUNER_METRICS", "operators", ("operators", "public", "off")),
    # What a client may send (common.inputs; docs/api.md, "Limits"). Over a limit: 413 for the body, else 400.
    "MAX_REQUEST_BYTES": _env_int("SIMPLETUNER_MAX_REQUEST_BYTES", 1024 * 1024, minimum=64 * 1024, maximum=256 * 1024 * 1024),
    "MAX_JSON_DEPTH": _env_int("SIMPLETUNER_MAX_JSON_DEPTH", 32, minimum=8, maximum=200),
    "MAX_LABELS": _env_int("SIMPLETUNER_MAX_LABELS", 32, minimum=1, maximum=1000),
    "MAX_GPU_INFO_BYTES": _env_int("SIMPLETUNER_MAX_GPU_INFO_BYTES", 64 * 1024, minimum=1024, maximum=16 * 1024 * 1024),
    # The artifact store (docs/operator-guide.md, "Configs and artifacts"): one file's limit, a job's quota, and how
    # many days an artifact is kept after its upload (0: kept until deleted by hand).
    "ARTIFACT_MAX_BYTES": _env_int("SIMPLETUNER_ARTIFACT_MAX_BYTES", 20 * 1024**3, minimum=1),
    "ARTIFACT_JOB_QUOTA_BYTES": _env_int("SIMPLETUNER_ARTIFACT_JOB_QUOTA_BYTES", 200 * 1024**3, minimum=1),
    "ARTIFACT_RETENTION_DAYS": _env_int("SIMPLETUNER_ARTIFACT_RETENTION_DAYS", 0, minimum=0, maximum=36500),
    "ARTIFACT_SWEEP_INTERVAL": _env_seconds("SIMPLETUNER_ARTIFACT_SWEEP_INTERVAL", 3600),
    # Request bodies spooled to disk by one server process, all together (serving.guard): past it, 503.
    "SPOOL_MAX_BYTES": _env_int("SIMPLETUNER_SPOOL_MAX_BYTES", 0, minimum=0),
    # Refuse (400 config_not_stored) a job whose config_name is not a stored config (docs/operator-guide.md).
    "REQUIRE_STORED_CONFIG": _env_bool("SIMPLETUNER_REQUIRE_STORED_CONFIG", False),
    # The half-life of the GPU usage that orders the shares of a fleet (job_queue.fairshare): 7 days.
    "FAIRSHARE_HALF_LIFE": _env_seconds("SIMPLETUNER_FAIRSHARE_HALF_LIFE", 7 * 24 * 3600),
    # Webhook URLs resolving to loopback, private, link-local, multicast or reserved addresses (docs/webhooks.md).
    "WEBHOOK_ALLOW_PRIVATE": _env_bool("SIMPLETUNER_WEBHOOK_ALLOW_PRIVATE", False),
    # Keys of configs and dataloaders whose values are secrets (training_configs.secrets): shell-style patterns,
    # comma-separated, matched case-insensitively at any depth; shown masked to readers without
    # configs.view_config_secrets. Agents always receive them.
    "SECRET_CONFIG_KEYS": tuple(
        p.strip().lower()
        for p in os.environ.get("SIMPLETUNER_SECRET_CONFIG_KEYS", "*token*,*secret*,*password*,*key*").split(",")
        if p.strip()
    ),
}

# Form posts (the admin) are bounded like API bodies. The spool holds one largest upload and 256 MiB besides, unless set.
DATA_UPLOAD_MAX_MEMORY_SIZE = SIMPLETUNER["MAX_REQUEST_BYTES"]
SIMPLETUNER["SPOOL_MAX_BYTES"] = SIMPLETUNER["SPOOL_MAX_BYTES"] or SIMPLETUNER["ARTIFACT_MAX_BYTES"] + 256 * 1024**2

# prometheus_client's multiprocess mode (observability.metrics): every orchestrator process on a host
# writes its counters there, and a scrape of any one of them sums them all.
_PROMETHEUS_MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
if _PROMETHEUS_MULTIPROC_DIR and not os.path.isdir(_PROMETHEUS_MULTIPROC_DIR):
    raise ImproperlyConfigured(
        f"PROMETHEUS_MULTIPROC_DIR must be an existing directory, got {_PROMETHEUS_MULTIPROC_DIR!r}"
    )

# --- Auth and API ---------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "workers.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Every operator endpoint declares the permission of each method it serves (common.permissions);
    # the worker protocol's views and the schema set their own.
    "DEFAULT_PERMISSION_CLASSES": ["common.permissions.OperatorPermission"],
    "EXCEPTION_HANDLER": "common.http.exception_handler",
    "DEFAULT_PAGINATION_CLASS": "common.pagination.LimitOffsetPagination",
    "DEFAULT_PARSER_CLASSES": ["common.parsers.JSONParser"],
    "PAGE_SIZE": 100,
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # Failed token authentications (worker and operator tokens, the worker stream too) per client
    # address: past the rate a refused token is answered 429 with Retry-After (workers.throttling).
    # Failed sign-ins with a password (admin and API login pages) per address and per username: past the
    # rate the login page answers 429 without checking the password, until the window ends.
    "DEFAULT_THROTTLE_RATES": {
        "failed_auth": _env_rate("SIMPLETUNER_FAILED_AUTH_RATE", "30/min"),
        "failed_login": _env_rate("SIMPLETUNER_FAILED_LOGIN_RATE", "10/min"),
    },
}
# OpenAPI schema at /api/schema/, Swagger UI at /api/docs/; both readable by any signed-in operator
# (session or Bearer token), like the rest of the API. The UI's JS/CSS come from the sidecar package,
# served by whitenoise, so the docs work without internet access.
SPECTACULAR_SETTINGS = {
    "TITLE": "SimpleTuner orchestrator API",
    "DESCRIPTION": (
        "Control plane for GPU training jobs. Operators authenticate with `Authorization: Bearer sta_...` "
        "(or a Django session); worker agents with `X-Worker-Token: wt_...`. Every error is JSON "
        '`{"code": "...", "detail": "..."}` (plus `errors` for field validation).'
    ),
    "VERSION": "1.0.0",
    # 3.1: JSON Schema 2020-12, so label names can be declared (propertyNames) as the server checks them.
    "OAS_VERSION": "3.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    "SCHEMA_PATH_PREFIX": r"/api/",
    "COMPONENT_SPLIT_REQUEST": True,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {
        "WorkerStatusEnum": "workers.models.WorkerStatus",
        "WorkerTypeEnum": "workers.models.WorkerType",
        "CreatableWorkerTypeEnum": ["ephemeral", "persistent"],
        "JobStatusEnum": "job_queue.models.JobStatus",
        "ReportedJobStatusEnum": list(protocol.REPORTED_STATUSES),
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "workers.api.schema.add_worker_stream_path",
        "common.http.add_throttled_responses",
        "common.http.any_value_is_nullable",
        "common.fields.add_json_value_schema",
    ],
}
APPEND_SLASH = False

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "simpletuner_site" / "static"]
STATIC_ROOT = DATA_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)


def _artifact_storage():
    """The artifact store: S3 (any S3-compatible service, via django-storages) when a bucket is named, else a
    directory under the data directory."""
    bucket = os.environ.get("SIMPLETUNER_ARTIFACT_S3_BUCKET", "").strip()
    if not bucket:
        location = Path(os.environ.get("SIMPLETUNER_ARTIFACT_DIR") or DATA_DIR / "artifacts").resolve()
        return {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(location)}}
    endpoint = os.environ.get("SIMPLETUNER_ARTIFACT_S3_ENDPOINT_URL", "").strip() or None
    if endpoint and urlparse(endpoint).scheme not in ("http", "https"):
        raise ImproperlyConfigured(f"SIMPLETUNER_ARTIFACT_S3_ENDPOINT_URL must be an http(s):// URL, got {endpoint!r}")
    from boto3.s3.transfer import TransferConfig

    # An upload is streamed: a few parts of 8 MiB in memory at once, whatever its size.
    transfer = TransferConfig(multipart_chunksize=8 * 1024 * 1024, max_concurrency=2)
    transfer.max_in_memory_upload_chunks = 2
    return {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "transfer_config": transfer,
            "bucket_name": bucket,
            "endpoint_url": endpoint,
            "region_name": os.environ.get("SIMPLETUNER_ARTIFACT_S3_REGION", "").strip() or None,
            # Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or any other source boto3 reads.
            "access_key": os.environ.get("AWS_ACCESS_KEY_ID") or None,
            "secret_key": os.environ.get("AWS_SECRET_ACCESS_KEY") or None,
            "file_overwrite": False,
            "default_acl": None,
            "querystring_auth": True,
            "querystring_expire": 300,
        },
    }


STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
    "artifacts": _artifact_storage(),
}
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if _env_bool("DJANGO_BEHIND_TLS_PROXY", False) else None

# --- HTTPS: on when the server serves TLS (`simpletuner server --ssl` sets SIMPLETUNER_TLS), sits
# behind a TLS proxy, or runs in production mode ----------------------------------------------------
SERVES_TLS = PRODUCTION or SECURE_PROXY_SSL_HEADER is not None or _env_bool("SIMPLETUNER_TLS", False)
SESSION_COOKIE_SECURE = SERVES_TLS
CSRF_COOKIE_SECURE = SERVES_TLS
SECURE_HSTS_SECONDS = _env_int("DJANGO_HSTS_SECONDS", 31_536_000 if SERVES_TLS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", True)
# Preloading is a commitment browsers keep for months, made by submitting the domain: the operator's
# call, off by default; Django's reminder about it (security.W021) is silenced until then.
SECURE_HSTS_PRELOAD = _env_bool("DJANGO_HSTS_PRELOAD", False)
SILENCED_SYSTEM_CHECKS = [] if SECURE_HSTS_PRELOAD else ["security.W021"]
# Plain HTTP is redirected to HTTPS by whoever terminates TLS: this server when it serves TLS itself in
# production; the proxy when there is one (deploy/nginx redirects port 80), since behind it this
# server's own port is plain HTTP on loopback, which the built-in local worker and a scraper use.
SECURE_SSL_REDIRECT = _env_bool("DJANGO_SECURE_SSL_REDIRECT", PRODUCTION and SECURE_PROXY_SSL_HEADER is None)
SECURE_REDIRECT_EXEMPT = [r"^metrics$"]  # a scraper on the server's own port
if SECURE_PROXY_SSL_HEADER is not None and not SECURE_SSL_REDIRECT:
    SILENCED_SYSTEM_CHECKS.append("security.W008")  # the TLS proxy redirects
# The stream URL handed to agents at registration. Unset: built from the request's Host, which
# ALLOWED_HOSTS bounds (set it to the address agents must use, e.g. https://orchestrator.example.com).
PUBLIC_URL = os.environ.get("SIMPLETUNER_PUBLIC_URL", "").rstrip("/")
if PUBLIC_URL and urlparse(PUBLIC_URL).scheme not in {"http", "https"}:
    raise ImproperlyConfigured(f"SIMPLETUNER_PUBLIC_URL must be an http(s):// URL, got {PUBLIC_URL!r}")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("SIMPLETUNER_LOG_LEVEL", "INFO")},
    "loggers": {
        "django_eventstream": {"level": "WARNING"},
        "django.db.backends": {"level": "WARNING"},
    },
}
