"""The `simpletuner` console script: `simpletuner server` runs the orchestrator, `simpletuner worker` the agent."""

import argparse
import datetime
import ipaddress
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SETTINGS_MODULE = "simpletuner_site.settings"
ASGI_APPLICATION = "simpletuner_site.asgi:application"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8001
CERT_VALID_DAYS = 825
MASK = "****"
_SECRET_QUERY_KEYS = ("password", "secret", "token")


class CLIError(Exception):
    """A failure to report as one line on stderr; ``status`` is the exit status."""

    def __init__(self, message, status=1):
        super().__init__(message)
        self.status = status


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser that reports a bad argument as one line on stderr (exit status 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# --- argument types -------------------------------------------------------------------------
def _port(raw):
    try:
        port = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {raw!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535, got {port}")
    return port


def _host(raw):
    host = raw.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "/[]" for c in host):
        raise argparse.ArgumentTypeError(f"not an address or host name: {raw!r}")
    return host


def _ip(host):
    """Return ``host`` as an IP address object, or None when it is a host name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# --- URLs and endpoints ---------------------------------------------------------------------
def mask_url(url):
    """Return ``url`` with its password, and any password/secret/token query value, replaced by ****."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{hostport}"
    query = []
    for pair in parts.query.split("&") if parts.query else []:
        key, eq, value = pair.partition("=")
        if eq and any(word in unquote(key).lower() for word in _SECRET_QUERY_KEYS):
            value = MASK
        query.append(f"{key}{eq}{value}")
    return urlunsplit(parts._replace(netloc=netloc, query="&".join(query)))


def _escape_endpoint_value(value):
    return str(value).replace("\\", "\\\\").replace(":", "\\:").replace("=", "\\=")


def endpoint_string(host, port, *, certfile=None, keyfile=None):
    """Return the Twisted endpoint description daphne listens on: tcp, or ssl when given a cert and key."""
    interface = _escape_endpoint_value(host)
    if certfile is None:
        return f"tcp:port={port}:interface={interface}"
    return (
        f"ssl:port={port}:interface={interface}"
        f":privateKey={_escape_endpoint_value(keyfile)}:certKey={_escape_endpoint_value(certfile)}"
    )


def public_url(scheme, host, port):
    """Return the URL clients use: the machine's host name when listening on every interface."""
    ip = _ip(host)
    if ip is not None and ip.is_unspecified:
        host = socket.gethostname()
    elif ip is not None and ip.version == 6:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _url(scheme, host, port):
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def loopback_host(host):
    """Return the address the built-in local worker dials to reach a server listening on ``host``.

    A wildcard address listens on loopback too; a specific address or host name listens only there.
    """
    ip = _ip(host)
    if ip is None:
        return "127.0.0.1" if host.lower() == "localhost" else host  # Twisted binds a host name over IPv4
    if ip.is_unspecified:
        return "127.0.0.1" if ip.version == 4 else "::1"
    return host


def _cert_names(cert):
    """Return (IP addresses, DNS names) of ``cert``'s subject alternative names."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), []
    return set(san.get_values_for_type(x509.IPAddress)), san.get_values_for_type(x509.DNSName)


def local_worker_endpoint(host, port, *, cert=None, certfile=None):
    """Return ``(url, ca_cert)``: how the built-in local worker reaches a server listening on ``host``.

    Without ``cert`` the URL is plain HTTP to the loopback address. Over TLS it names a host the
    certificate covers: that address if it does, else ``localhost`` (for a loopback address), else the
    certificate's first DNS name. ``ca_cert`` is ``certfile`` when the certificate is self-signed (the
    agent trusts exactly it), else None (the agent uses the system's trust store).
    """
    address = loopback_host(host)
    if cert is None:
        return _url("http", address, port), None
    ips, dns_names = _cert_names(cert)
    ip = _ip(address)
    if ip in ips if ip is not None else address.lower() in {name.lower() for name in dns_names}:
        name = address
    elif ip is not None and ip.is_loopback and "localhost" in dns_names:
        name = "localhost"
    else:
        name = next((dns for dns in dns_names if not dns.startswith("*")), address)
    ca_cert = certfile if cert.issuer == cert.subject else None
    return _url("https", name, port), ca_cert


# --- TLS ------------------------------------------------------------------------------------
def cert_fingerprint(cert):
    """Return the SHA-256 fingerprint of ``cert`` as colon-separated upper-case hex, as openssl prints it."""
    return ":".join(f"{byte:02X}" for byte in cert.fingerprint(hashes.SHA256()))


def load_tls_pair(certfile, keyfile):
    """Return the certificate in ``certfile``; raise CLIError (status 2) unless it and ``keyfile`` form a pair."""
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not path.is_file():
            raise CLIError(f"{flag} {path}: no such file", status=2)
    try:
        cert = x509.load_pem_x509_certificate(certfile.read_bytes())
    except (OSError, ValueError) as exc:
        raise CLIError(f"--ssl-certfile {certfile}: not a PEM certificate ({exc})", status=2) from None
    try:
        key = serialization.load_pem_private_key(keyfile.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CLIError(f"--ssl-keyfile {keyfile}: not an unencrypted PEM private key ({exc})", status=2) from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise CLIError(f"--ssl-keyfile {keyfile} is not the key of --ssl-certfile {certfile}", status=2)
    return cert


def _subject_alt_names(host):
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    ip = _ip(host)
    if ip is None or not ip.is_unspecified:
        names.append(host)
    entries = []
    for name in dict.fromkeys(names):
        ip = _ip(name)
        entries.append(x509.IPAddress(ip) if ip is not None else x509.DNSName(name))
    return entries


def _self_signed_cert(key, host):
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "SimpleTuner orchestrator (self-signed)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    public_key = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(_subject_alt_names(host)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key), critical=False)
        .sign(key, hashes.SHA256())
    )


def ensure_self_signed_cert(tls_dir, host):
    """Return (cert path, key path, created): the pair in ``tls_dir``, generated there if it has none.

    The pair is written into a private temporary directory that is then renamed to ``tls_dir``, so two
    servers starting at once on one data directory end up sharing one matching pair.
    Raise CLIError if ``tls_dir`` holds only one of the two files.
    """
    cert_path, key_path = tls_dir / "cert.pem", tls_dir / "key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path, False
    if cert_path.exists() or key_path.exists():
        raise CLIError(f"{tls_dir} holds only one of cert.pem and key.pem; remove the directory to generate a new pair")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _self_signed_cert(key, host)
    tls_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tls-", dir=tls_dir.parent))
    try:
        key_fd = os.open(staging / "key.pem", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(key_fd, "wb") as fh:
            fh.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        (staging / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        try:
            os.rename(staging, tls_dir)
        except OSError:
            if not (cert_path.exists() and key_path.exists()):
                raise
            return cert_path, key_path, False  # another server generated the pair first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cert_path, key_path, True


# --- the `server` subcommand ----------------------------------------------------------------
def banner_lines(*, settings, url, listen, cert_path=None, fingerprint=None, cert_note="", local_worker=None):
    """Return the start-up banner; every URL in it has its password masked.

    ``local_worker`` is the built-in local worker's name, or None when it is disabled.
    """
    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("sqlite3"):
        db_line = f"SQLite {database['NAME']}"
    else:
        db_line = f"{database['ENGINE'].rsplit('.', 1)[-1]} {mask_url(settings.DATABASE_URL)}"
    if settings.REDIS_URL:
        mode_line = f"Redis {mask_url(settings.REDIS_URL)} (events across processes, Celery broker)"
    else:
        mode_line = "embedded (no REDIS_URL: events and background work stay in this process)"
    lines = [
        "SimpleTuner orchestrator",
        f"  URL          {url}  (listening on {listen})",
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
    lines.append("  API token    python manage.py create_api_token USERNAME --superuser")
    return lines


def add_server_command(subcommands):
    parser = subcommands.add_parser(
        "server",
        help="run the orchestrator (REST API, worker streams, admin)",
        description="Apply database migrations, then serve the orchestrator with daphne (ASGI).",
    )
    parser.add_argument(
        "--host",
        type=_host,
        default=DEFAULT_HOST,
        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; "
        "--host 0.0.0.0 exposes the server on every IPv4 interface)",
    )
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument(
        "--ssl",
        action="store_true",
        help="serve HTTPS; without --ssl-certfile/--ssl-keyfile a self-signed certificate is generated "
        "into <data dir>/tls on first use and its SHA-256 fingerprint printed at every start",
    )
    parser.add_argument("--ssl-certfile", type=Path, metavar="PATH", help="PEM certificate (implies --ssl)")
    parser.add_argument("--ssl-keyfile", type=Path, metavar="PATH", help="PEM private key, unencrypted (implies --ssl)")
    parser.add_argument(
        "--no-migrate", dest="migrate", action="store_false", help="do not apply database migrations at start"
    )
    parser.add_argument(
        "--proxy-headers",
        action="store_true",
        help="take the client address and scheme from X-Forwarded-For/-Port/-Proto (behind a reverse proxy only)",
    )
    parser.add_argument(
        "--no-local-worker",
        dest="local_worker",
        action="store_false",
        help="do not start the built-in local worker (the agent on this machine). Jobs with target local "
        "run only on it and wait without it; auto jobs prefer an idle matching remote worker and fall back to it",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request to stdout")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: migration output, access log and the local worker's debug output; -vv: also Twisted's log",
    )
    parser.set_defaults(handler=run_server)


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
    import django
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import call_command
    from django.db import DatabaseError, connections

    try:
        django.setup()
    except ImproperlyConfigured as exc:
        raise CLIError(f"configuration: {exc}") from None
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
        cert = x509.load_pem_x509_certificate(certfile.read_bytes())
        fingerprint = cert_fingerprint(cert)
        cert_note = " (self-signed, generated now)" if created else " (self-signed)"

    scheme = "https" if certfile else "http"
    listen = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
    ip = _ip(args.host)
    if ip is not None and ip.is_unspecified:
        listen += ", every interface"
    lines = banner_lines(
        settings=settings,
        url=public_url(scheme, args.host, args.port),
        listen=listen,
        cert_path=certfile,
        fingerprint=fingerprint,
        cert_note=cert_note,
        local_worker=settings.SIMPLETUNER["LOCAL_WORKER_NAME"] if args.local_worker else None,
    )
    print("\n".join(lines), flush=True)

    from daphne.cli import CommandLineInterface

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
        if not settings.REDIS_URL:
            # Embedded mode: no broker, so the sweeps Celery beat would run are run in-process instead.
            from .scheduler import EmbeddedScheduler

            scheduler = EmbeddedScheduler().start()
            print("Sweeps: embedded scheduler (no REDIS_URL); with Redis run Celery beat instead", flush=True)
        if args.local_worker:
            local_worker = start_local_worker(
                settings=settings, host=args.host, port=args.port, cert=cert, certfile=certfile, verbose=args.verbose
            )
        if local_worker is not None:
            from twisted.internet import reactor, threads  # daphne has installed its asyncio reactor by now

            # Stop the agent while the server still answers, so that it can report its job and disconnect.
            reactor.addSystemEventTrigger("before", "shutdown", threads.deferToThread, local_worker.stop)
        CommandLineInterface().run([*daphne_args, ASGI_APPLICATION])
    finally:
        if local_worker is not None:
            local_worker.stop()
        if scheduler is not None:
            scheduler.stop()
        presence.stop()
    return 0


def start_presence_beacon():
    """Record this server process's presence now and every few seconds (see ``ServerPresence``).

    The heartbeat sweep, wherever it runs, takes workers offline only while some server was up to hear
    them; a server that stops or dies stops writing, and its silence is the signal.
    """
    import functools
    import secrets

    from django.utils import timezone

    from workers.services import presence_interval, server_presence_beat

    from .scheduler import EmbeddedScheduler

    hostname, pid = socket.gethostname(), os.getpid()
    beat = functools.partial(
        server_presence_beat,
        process_id=f"{hostname}:{pid}:{secrets.token_hex(4)}",
        hostname=hostname,
        pid=pid,
        started_at=timezone.now(),
    )
    beacon = EmbeddedScheduler(schedule=[("server presence", beat, presence_interval())])
    beacon.run_once("server presence", beat)
    return beacon.start()


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


# --- the `worker` subcommand ----------------------------------------------------------------
WORKER_HELP = "run the worker agent on a GPU node (the same program as python -m worker_agent)"
WORKER_DESCRIPTION = (
    "Register with an orchestrator, keep its event stream open and run the training jobs it sends. "
    "The worker token is read from SIMPLETUNER_WORKER_TOKEN (or --worker-token)."
)


def add_worker_command(subcommands):
    """Add `simpletuner worker`, whose arguments and handler are ``worker_agent.cli``'s (one program)."""
    from worker_agent.cli import add_arguments, run

    parser = subcommands.add_parser("worker", help=WORKER_HELP, description=WORKER_DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(handler=run)


# --- entry point ----------------------------------------------------------------------------
def build_parser():
    parser = ArgumentParser(prog="simpletuner", description="SimpleTuner orchestrator.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_server_command(subcommands)
    add_worker_command(subcommands)
    return parser


def main(argv=None):
    """Run the console script; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except CLIError as exc:
        print(f"simpletuner {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
