"""Who is on the other end of a request (no DRF import: the audit layer uses it)."""


def client_ip(request):
    """Return the peer address of ``request`` (REMOTE_ADDR; put a proxy's X-Forwarded-For handling here)."""
    return request.META.get("REMOTE_ADDR") or None
