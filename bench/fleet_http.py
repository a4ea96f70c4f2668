"""A small HTTP/1.1 client on asyncio streams for the fleet simulator: keep-alive requests and SSE streams.

Thousands of simulated workers share two cores with the server under test, so the client is kept
cheap: no third-party HTTP library, one keep-alive connection per in-flight request (pooled), and an
SSE reader that parses only what the protocol needs (``event:``/``data:`` lines, chunked bodies).
"""

import asyncio
import json
import time
from urllib.parse import urlsplit


class HTTPError(Exception):
    pass


def _split(base_url):
    u = urlsplit(base_url)
    if u.scheme != "http" or not u.hostname:
        raise HTTPError(f"only http://host:port base URLs are supported, got {base_url!r}")
    return u.hostname, u.port or 80


async def _read_head(reader):
    """Return (status, headers dict with lower-case names) of one response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise HTTPError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _read_chunked(reader):
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


class Client:
    """Keep-alive HTTP client for one server: ``await request(method, path, json=..., headers=...)``."""

    def __init__(self, base_url, pool=256, timeout=60):
        self.base_url = base_url.rstrip("/")
        self.host, self.port = _split(self.base_url)
        self.timeout = timeout
        self._idle = []
        self._slots = asyncio.Semaphore(pool)
        self.requests = 0

    async def _connect(self, fresh=False):
        if self._idle and not fresh:
            return self._idle.pop()
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def request(self, method, path, *, json_body=None, headers=None):
        """Return (status, parsed JSON or None, seconds). Raise HTTPError on a broken connection."""
        payload = b"" if json_body is None else json.dumps(json_body).encode()
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: application/json",
                 f"Content-Length: {len(payload)}"]
        if json_body is not None:
            lines.append("Content-Type: application/json")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload
        async with self._slots:
            t0 = time.perf_counter()
            for attempt in (0, 1):
                # a pooled keep-alive connection the server closed meanwhile (uvicorn: after 5 s idle) fails
                # at once: the one retry is on a fresh connection
                try:
                    reader, writer = await self._connect(fresh=attempt > 0)
                except OSError as exc:
                    raise HTTPError(f"{method} {path}: {exc!r}") from None
                try:
                    writer.write(raw)
                    status, head = await asyncio.wait_for(_read_head(reader), self.timeout)
                    if head.get("transfer-encoding", "").lower() == "chunked":
                        body = await _read_chunked(reader)
                    else:
                        body = await reader.readexactly(int(head.get("content-length", "0")))
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                    writer.close()
                    if attempt == 0:
                        continue
                    raise HTTPError(f"{method} {path}: {exc!r}") from None
                except asyncio.TimeoutError:
                    writer.close()
                    raise HTTPError(f"{method} {path}: no answer within {self.timeout} s") from None
                break
            elapsed = time.perf_counter() - t0
            if head.get("connection", "").lower() == "close":
                writer.close()
            else:
                self._idle.append((reader, writer))
        self.requests += 1
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        return status, data, elapsed

    def close(self):
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


class Stream:
    """One SSE stream: ``await open()``, then ``async for (event, data) in events()``; ``close()``."""

    def __init__(self, base_url, path, headers):
        self.host, self.port = _split(base_url)
        self.path, self.headers = path, headers
        self.reader = self.writer = None
        self.status = None

    async def open(self, timeout=60):
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        lines = [f"GET {self.path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: text/event-stream"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        self.status, head = await asyncio.wait_for(_read_head(self.reader), timeout)
        self.chunked = head.get("transfer-encoding", "").lower() == "chunked"
        return self.status

    async def _pieces(self):
        if not self.chunked:
            while True:
                piece = await self.reader.read(65536)
                if not piece:
                    return
                yield piece
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                return
            yield await self.reader.readexactly(size)
            await self.reader.readexactly(2)

    async def events(self):
        """Yield (event name or None, parsed data or None) per SSE event until the stream ends."""
        buf = b""
        try:
            async for piece in self._pieces():
                buf += piece
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    event, data = None, []
                    for line in block.decode("utf-8", "replace").split("\n"):
                        if line.startswith("event:"):
                            event = line[6:].strip()
                        elif line.startswith("data:"):
                            data.append(line[5:].lstrip(" "))
                    parsed = None
                    if data:
                        try:
                            parsed = json.loads("\n".join(data))
                        except ValueError:
                            parsed = None
                    yield event, parsed
        except (OSError, asyncio.IncompleteReadError, ValueError):
            return

    def close(self):
        if self.writer is not None:
            self.writer.close()
