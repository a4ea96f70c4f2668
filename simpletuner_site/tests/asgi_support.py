"""Calling an ASGI application the way daphne does, for tests: one request in, the whole answer out."""

from asgiref.testing import ApplicationCommunicator


async def asgi_request(app, method, path, *, body=b"", headers=(), scheme="http"):
    """Send one HTTP request to ``app``; return ``(status, headers as a dict, body)``."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": scheme,
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1234),
             "server": ("testserver", 80)}
    start, out = await asgi_exchange(app, scope, body=body)
    return start["status"], dict(start["headers"]), out


async def asgi_exchange(app, scope, *, body=b""):
    """Send one HTTP request (``scope`` and ``body``) to ``app``; return its start message and its whole body."""
    comm = ApplicationCommunicator(app, scope)
    await comm.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await comm.receive_output(10)
    out = await rest_of_body(comm)
    await comm.wait(10)
    return start, out


async def rest_of_body(comm):
    """Read the body messages ``comm``'s application sends until its last one; return the bytes."""
    out = b""
    while True:
        message = await comm.receive_output(10)
        out += message.get("body", b"")
        if not message.get("more_body"):
            return out
