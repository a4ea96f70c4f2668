"""Calling an ASGI application the way daphne does, for tests: one request in, the whole answer out."""

from asgiref.testing import ApplicationCommunicator


async def asgi_request(app, method, path, *, body=b"", headers=(), scheme="http"):
    """Send one HTTP request to ``app``; return ``(status, headers as a dict, body)``."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": scheme,
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1234),
             "server": ("testserver", 80)}
    comm = ApplicationCommunicator(app, scope)
    await comm.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await comm.receive_output(10)
    out = b""
    while True:
        message = await comm.receive_output(10)
        out += message.get("body", b"")
        if not message.get("more_body"):
            break
    await comm.wait(10)
    return start["status"], dict(start["headers"]), out
