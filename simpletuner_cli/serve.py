"""`simpletuner server`: read the environment file, check the database and Redis, apply migrations, print the banner
and serve the orchestrator with daphne."""

import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from .endpoints import endpoint_string, listen_address, local_worker_endpoint, mask_url, public_url
from .errors import CLIError
from .presence import end_presence, start_embedded_sweeps, start_presence_beacon
from .tls import cert_fingerprint, ensure_self_signed_cert, load_cert, load_tls_pair

SETTINGS_MODULE = "simpletuner_site.settings"
ASGI_APPLICATION = "simpletuner_site.asgi:application"
# Start-up checks: each try to reach the database, and Redis, gives up after this long (issue 32: within 10 s).
DATABASE_CONNECT_TIMEOUT_S = 5
REDIS_CONNECT_TIMEOUT_S = 2


def banner_lines(*, settings, url, listen, cert_path=None, fingerprint=None, cert_note="", local_worker=None):
    """Return the start-up banner; every URL in it has its password masked.

    ``local_worker`` is the built-in local worker's name, or None when it is disabled.
    """
    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("sqlite3"):
        db_line = f"SQLite {database['NAME']}" + ("" if settings.DATABASE_URL else " (embedded: DATABASE_URL is not set)")
    else:
        db_line = f"{database['ENGINE'].rsplit('.', 1)[-1]} {mask_url(settings.DATABASE_URL)}"
    if settings.REDIS_URL:
        mode_line = f"Redis {mask_url(settings.REDIS_URL)} (events across processes, Celery broker)"
    else:
        mode_line = "embedded (no REDIS_URL: events and background work stay in this process)"
    lines = [
        "SimpleTuner orchestrator",
        f"  URL          {url}  (listening on {listen})",
        *([f"  Env file     {settings.ENV_FILE}"] if getattr(settings, "ENV_FILE", None) else []),
        f"  Data dir     {settings.DATA_DIR}",
        f"  Database     {db_line}",
        f"  Mode         {mode_line}",
    ]
    if local_worker is None:
        lines.append("  Local worker disabled (--no-local-worker: jobs with target local wait)")
    else:
        lines.append(f"  Local worker {local_worker} (jobs with target local/auto; --no-local-worker to disable)")
    if cert_path is not None:
        lines.append(f"  TLS cert     {cert_path}{cert_note}")
        lines.append(f"  SHA-256      {fingerprint}")
    env_file = f"SIMPLETUNER_ENV_FILE={settings.ENV_FILE} " if getattr(settings, "ENV_FILE", None) else ""
    lines.append(f"  API token    {env_file}python manage.py create_api_token USERNAME --superuser")
    return lines


def run_server(args):
    """Apply migrations (unless --no-migrate), print the banner and serve until SIGINT/SIGTERM."""
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise CLIError(
            "--ssl-certfile and --ssl-keyfile go together: give both, or neither to use a generated certificate",
            status=2,
        )
    supplied_cert = None
    if args.ssl_certfile is not None:
        args.ssl_certfile, args.ssl_keyfile = args.ssl_certfile.resolve(), args.ssl_keyfile.resolve()
        supplied_cert = load_tls_pair(args.ssl_certfile, args.ssl_keyfile)

    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS_MODULE
    from django.core.exceptions import ImproperlyConfigured

    from simpletuner_site.env import load_env_file

    try:
        load_env_file()  # first: the file may set PROMETHEUS_MULTIPROC_DIR, which prometheus_client reads at import
    except ImproperlyConfigured as exc:
        raise CLIError(f"configuration: {exc}", status=2) from None
    refuse_port_in_use(args.host, args.port)
    # Outside production mode ALLOWED_HOSTS admits these besides loopback and this machine's names (settings):
    # the address listened on, and the name the local worker dials (a supplied certificate's, if not that).
    local_worker_host = urlsplit(local_worker_endpoint(args.host, args.port, cert=supplied_cert)[0]).hostname
    os.environ["SIMPLETUNER_SERVER_HOSTS"] = ",".join(dict.fromkeys([args.host, local_worker_host]))
    if args.ssl or supplied_cert is not None:
        os.environ["SIMPLETUNER_TLS"] = "true"  # secure cookies and HSTS (settings.SERVES_TLS)
    import django
    from django.conf import settings
    from django.core.management import call_command
    from django.db import DatabaseError, connections

    try:
        django.setup()
    except ImproperlyConfigured as exc:
        raise CLIError(f"configuration: {exc}") from None
    check_database(settings)
    check_redis(settings)
    if args.migrate:
        try:
            call_command("migrate", interactive=False, verbosity=1 if args.verbose else 0)
        except DatabaseError as exc:
            raise CLIError(f"could not apply migrations: {exc}") from None
        finally:
            connections.close_all()  # the server's threads open their own

    cert = certfile = keyfile = fingerprint = None
    cert_note = ""
    if supplied_cert is not None:
        cert, certfile, keyfile = supplied_cert, args.ssl_certfile, args.ssl_keyfile
        fingerprint = cert_fingerprint(cert)
    elif args.ssl:
        certfile, keyfile, created = ensure_self_signed_cert(Path(settings.DATA_DIR) / "tls", args.host)
        cert = load_cert(certfile)
        fingerprint = cert_fingerprint(cert)
        cert_note = " (self-signed, generated now)" if created else " (self-signed)"

    scheme = "https" if certfile else "http"
    lines = banner_lines(
        settings=settings,
        url=public_url(scheme, args.host, args.port),
        listen=listen_address(args.host, args.port),
        cert_path=certfile,
        fingerprint=fingerprint,
        cert_note=cert_note,
        local_worker=settings.SIMPLETUNER["LOCAL_WORKER_NAME"] if args.local_worker else None,
    )
    print("\n".join(lines), flush=True)

    from serving.daphne import SpooledBodyCommandLineInterface

    daphne_args = [
        "--endpoint",
        endpoint_string(args.host, args.port, certfile=certfile, keyfile=keyfile),
        "--verbosity",
        str(min(args.verbose, 2)),
    ]
    if args.access_log:
        daphne_args += ["--access-log", "-"]
    if args.proxy_headers:
        daphne_args.append("--proxy-headers")
    scheduler = local_worker = None
    presence = start_presence_beacon()
    try:
        scheduler = start_embedded_sweeps(settings)
        if args.local_worker:
            local_worker = start_local_worker(
                settings=settings, host=args.host, port=args.port, cert=cert, certfile=certfile, verbose=args.verbose
            )
        # Stop the agent while the server still answers, so that it can report its job and disconnect.
        before_stopping = (local_worker.stop,) if local_worker is not None else ()
        SpooledBodyCommandLineInterface(before_stopping=before_stopping).run([*daphne_args, ASGI_APPLICATION])
    finally:
        if local_worker is not None:
            local_worker.stop()
        if scheduler is not None:
            scheduler.stop()
        presence.stop()
        end_presence()
    return 0


def check_database(settings, timeout=DATABASE_CONNECT_TIMEOUT_S):
    """Connect to the database once, directly (no pool), within ``timeout`` seconds each try.

    Raise CLIError with the driver's own reason (``database "x" does not exist``, ``connection refused``) if it cannot
    be used: psycopg's pool would wait 30 s for a connection it cannot make and then drop the reason.
    """
    from django.db import DatabaseError, connections

    connection = connections["default"]
    where = connection.settings_dict["NAME"] if connection.vendor == "sqlite" else mask_url(settings.DATABASE_URL)
    try:
        if connection.vendor == "postgresql":
            params = connection.get_connection_params()
            configured = float(params.get("connect_timeout") or timeout)
            params["connect_timeout"] = max(1, round(min(configured, timeout)))
            connection.Database.connect(**params).close()
        else:
            connection.ensure_connection()
            connection.close()
    except (DatabaseError, connection.Database.Error) as exc:
        reason = " ".join(str(exc).split())
        raise CLIError(f"cannot use the database {where}: {reason.rstrip('.')} (check DATABASE_URL)") from None


def check_redis(settings, timeout=REDIS_CONNECT_TIMEOUT_S):
    """Ping REDIS_URL, if set, within ``timeout`` seconds; raise CLIError in production mode if it does not answer,
    else print a warning on stderr (the server serves, and its event listener keeps trying)."""
    if not settings.REDIS_URL:
        return
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
        return
    except redis.RedisError as exc:
        reason = " ".join(str(exc).split()).rstrip(".")
    finally:
        client.close()
    where = mask_url(settings.REDIS_URL)
    if settings.PRODUCTION:
        raise CLIError(
            f"Redis {where} does not answer: {reason} (production mode needs it: it carries events between the "
            "server processes and is Celery's broker; check REDIS_URL and that redis-server runs)"
        )
    print(
        f"simpletuner server: warning: Redis {where} does not answer: {reason}; serving anyway: until it answers, "
        "events reach only the streams this process holds (its listener keeps trying) and Celery beat cannot hand "
        "out the sweeps",
        file=sys.stderr,
        flush=True,
    )


def refuse_port_in_use(host, port):
    """Raise CLIError, one line naming the port and how to choose another, if ``host:port`` cannot be listened on."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror} (check --host)", status=2) from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as daphne listens: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CLIError(
                    f"port {port} on {host} is already in use (another orchestrator?): stop it, or choose another "
                    f"port with --port N (make run PORT=N)"
                ) from None
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise CLIError(f"not allowed to listen on {host}:{port} (ports below 1024 need privileges): use --port N") from None
            raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror} (check --host and --port)") from None


def start_local_worker(*, settings, host, port, cert=None, certfile=None, verbose=0):
    """Start the built-in local worker and return it; None if another server process on the data dir runs it.

    Raise CLIError if its lock file in the data directory cannot be opened.
    """
    from .local_worker import LocalWorker

    url, ca_cert = local_worker_endpoint(host, port, cert=cert, certfile=certfile)
    worker = LocalWorker(
        url=url,
        data_dir=settings.DATA_DIR,
        name=settings.SIMPLETUNER["LOCAL_WORKER_NAME"],
        ca_cert=ca_cert,
        verbose=verbose >= 1,
    )
    try:
        started = worker.start()
    except OSError as exc:
        raise CLIError(
            f"local worker: {exc.filename or worker.lock_path}: {exc.strerror} "
            "(make the data directory writable, or pass --no-local-worker)"
        ) from None
    return worker if started else None
