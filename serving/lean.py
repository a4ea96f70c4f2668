"""Shared by the ASGI endpoints that answer a plain request below Django: the head Django's middleware gives it."""

from django.conf import settings
from django.http.request import split_domain_port, validate_host


def plain_headers(scope):
    """Return the request's headers as ``{lower-case name: value}`` (bytes), or None where Django might read the
    request otherwise than a lean endpoint would: a repeated header (Django joins them), a header name with
    ``_`` (Django reads ``a_b`` as ``a-b``), a ``root_path``, or ``DISALLOWED_USER_AGENTS`` to check."""
    if scope.get("root_path") or settings.DISALLOWED_USER_AGENTS:
        return None
    headers = {}
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name in headers or b"_" in name:
            return None
        headers[name] = value
    return headers


def security_headers(scope, headers):
    """Return what Django's SecurityMiddleware adds to an answer to this request (HSTS when secure, nosniff,
    Referrer-Policy, Cross-Origin-Opener-Policy; in that order), or None where the middleware would answer
    otherwise: a host not allowed (DisallowedHost), an X-Forwarded-Host, a redirect to HTTPS.

    ``headers`` maps the request's header names, as the server gives them (lower case bytes), to values.
    """
    host = headers.get(b"host")
    if host is None or b"x-forwarded-host" in headers:
        return None
    domain, _ = split_domain_port(host.decode("latin-1"))
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return None  # Django's DisallowedHost
    secure = scope.get("scheme") == "https"
    if settings.SECURE_PROXY_SSL_HEADER:
        name, expected = settings.SECURE_PROXY_SSL_HEADER
        header = name.removeprefix("HTTP_").replace("_", "-").lower().encode("latin-1")
        forwarded = headers.get(header)
        if forwarded is not None:
            secure = forwarded.decode("latin-1").split(",", 1)[0].strip() == expected
    if settings.SECURE_SSL_REDIRECT and not secure:
        return None  # redirected (no exemption covers the API)
    out = []
    if secure and settings.SECURE_HSTS_SECONDS:
        hsts = f"max-age={settings.SECURE_HSTS_SECONDS}"
        if settings.SECURE_HSTS_INCLUDE_SUBDOMAINS:
            hsts += "; includeSubDomains"
        if settings.SECURE_HSTS_PRELOAD:
            hsts += "; preload"
        out.append((b"Strict-Transport-Security", hsts.encode()))
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        out.append((b"X-Content-Type-Options", b"nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        policy = settings.SECURE_REFERRER_POLICY
        policy = policy if isinstance(policy, str) else ",".join(policy)
        out.append((b"Referrer-Policy", policy.encode()))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        out.append((b"Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY.encode()))
    return out


def replay(messages, receive):
    """A ``receive`` that gives ``messages`` (already read) again, then reads on."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
