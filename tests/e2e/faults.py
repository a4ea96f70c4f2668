"""Network faults for end-to-end tests: a TCP proxy that can cut its link or drop one SSE event.

Standard library only. ``TcpProxy`` forwards every connection made to it to one target address,
each direction on its own thread. ``cut()`` resets every live connection and refuses new ones (each
is accepted and reset at once, so a client fails fast rather than waiting on a timeout) until
``heal()``. ``drop_next("job_submit")`` swallows the next server-to-client HTTP body chunk carrying
that SSE event: the proxy reads the server's HTTP/1.1 responses chunk by chunk, so dropping one keeps
the chunked framing intact and the stream stays open, as if that one event had been lost in transit.
"""

import socket
import struct
import threading

ACCEPT_POLL_S = 0.2
CONNECT_TIMEOUT_S = 5
RECV_BYTES = 65536
MAX_HEADER_BYTES = 65536
MAX_CHUNK_LINE_BYTES = 1024


def _abort(sock):
    """Close ``sock`` with a reset (not a graceful FIN), waking any thread blocked reading it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class ResponseFramer:
    """Splits a server's HTTP/1.1 byte stream into whole units: a response head, a body chunk, raw bytes.

    ``feed(data)`` returns the bytes to pass on. Each complete chunk of a chunked body is offered to
    ``drop(payload)``; when that returns True the chunk (framing included) is left out. Anything it
    cannot parse is passed through unchanged from then on.
    """

    def __init__(self, drop):
        self._drop = drop
        self._buffer = b""
        self._state = "head"
        self._remaining = 0

    def feed(self, data):
        self._buffer += data
        out = []
        while self._buffer:
            if self._state == "raw":
                out.append(self._buffer)
                self._buffer = b""
            elif self._state == "head":
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > MAX_HEADER_BYTES:
                        self._state = "raw"
                        continue
                    break
                head, self._buffer = self._buffer[: end + 4], self._buffer[end + 4 :]
                out.append(head)
                self._state, self._remaining = self._body_of(head)
            elif self._state == "length":
                part = self._buffer[: self._remaining]
                self._buffer = self._buffer[len(part) :]
                self._remaining -= len(part)
                out.append(part)
                if self._remaining == 0:
                    self._state = "head"
            else:  # "chunk": a size line, then that many bytes and CRLF
                eol = self._buffer.find(b"\r\n")
                if eol < 0:
                    if len(self._buffer) > MAX_CHUNK_LINE_BYTES:
                        self._state = "raw"
                        continue
                    break
                try:
                    size = int(self._buffer[:eol].split(b";")[0].strip(), 16)
                except ValueError:
                    self._state = "raw"
                    continue
                if size == 0:  # the last chunk, then optional trailers, then an empty line
                    end = self._buffer.find(b"\r\n\r\n", eol)
                    if end < 0:
                        break
                    out.append(self._buffer[: end + 4])
                    self._buffer = self._buffer[end + 4 :]
                    self._state = "head"
                    continue
                total = eol + 2 + size + 2
                if len(self._buffer) < total:
                    break
                unit, self._buffer = self._buffer[:total], self._buffer[total:]
                if not self._drop(unit[eol + 2 : eol + 2 + size]):
                    out.append(unit)
        return b"".join(out)

    def flush(self):
        """Return whatever is buffered (the connection is ending)."""
        rest, self._buffer = self._buffer, b""
        return rest

    @staticmethod
    def _body_of(head):
        lines = head.decode("latin-1").split("\r\n")
        try:
            code = int(lines[0].split()[1])
        except (IndexError, ValueError):
            return "raw", 0
        if 100 <= code < 200 or code in (204, 304):
            return "head", 0
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return "chunk", 0
        if "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                return "raw", 0
            return ("length", length) if length > 0 else ("head", 0)
        return "raw", 0  # delimited by the connection's end


class _Link:
    """One proxied connection: the client's socket, the upstream socket and a pump thread per direction."""

    def __init__(self, proxy, client, upstream):
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self._done = 0
        self._lock = threading.Lock()

    def start(self):
        framer = ResponseFramer(self.proxy._should_drop)
        threading.Thread(target=self._pump, args=(self.client, self.upstream, None), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.upstream, self.client, framer), daemon=True).start()

    def _pump(self, source, sink, framer):
        try:
            while True:
                data = source.recv(RECV_BYTES)
                if not data:
                    if framer is not None:
                        sink.sendall(framer.flush())
                    sink.shutdown(socket.SHUT_WR)  # pass the half-close on
                    break
                if framer is not None:
                    data = framer.feed(data)
                if data:
                    sink.sendall(data)
        except OSError:
            self.abort()  # one side failed (or the link was cut): end both
        finally:
            with self._lock:
                self._done += 1
                finished = self._done == 2
            if finished:
                self.close()

    def close(self):
        for sock in (self.client, self.upstream):
            try:
                sock.close()
            except OSError:
                pass
        self.proxy._forget(self)

    def abort(self):
        _abort(self.client)
        _abort(self.upstream)
        self.proxy._forget(self)


class TcpProxy:
    """A TCP forwarder on a free port of 127.0.0.1 to ``target_host:target_port``; ``start()`` it first.

    ``cut()`` resets every live connection and resets each new one at once until ``heal()``.
    ``drop_next(event_type)`` drops the next server-to-client chunk holding ``event: <event_type>``;
    what was dropped is in ``dropped`` (bytes payloads, in order). ``stop()`` ends everything.
    """

    def __init__(self, target_host, target_port, *, host="127.0.0.1"):
        self.target = (target_host, target_port)
        self.host = host
        self.port = None
        self.dropped = []
        self.refused = 0  # connections reset on arrival while cut
        self._listener = None
        self._thread = None
        self._links = set()
        self._armed = []
        self._cut = False
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def url(self):
        return f"http://{self.host}:{self.port}"

    def start(self):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL_S)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def _accept_loop(self):
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                refuse = self._cut or self._stopped.is_set()
                if refuse:
                    self.refused += 1
            if refuse:
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
            except OSError:
                _abort(client)
                continue
            upstream.settimeout(None)
            link = _Link(self, client, upstream)
            with self._lock:
                if self._cut or self._stopped.is_set():  # cut while connecting upstream
                    link = None
                else:
                    self._links.add(link)
            if link is None:
                _abort(client)
                _abort(upstream)
                continue
            link.start()

    def _forget(self, link):
        with self._lock:
            self._links.discard(link)

    def _should_drop(self, payload):
        with self._lock:
            for index, marker in enumerate(self._armed):
                if marker in payload:
                    del self._armed[index]
                    self.dropped.append(payload)
                    return True
        return False

    def live_connections(self):
        with self._lock:
            return len(self._links)

    def cut(self):
        """Reset every live connection and refuse new ones until ``heal()``."""
        with self._lock:
            self._cut = True
            links = list(self._links)
        for link in links:
            link.abort()

    def heal(self):
        """Forward new connections again."""
        with self._lock:
            self._cut = False

    def drop_next(self, event_type):
        """Drop the next server-to-client chunk carrying the SSE event ``event_type`` (once)."""
        with self._lock:
            self._armed.append(f"event: {event_type}\n".encode())

    def stop(self):
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            links = list(self._links)
        for link in links:
            link.abort()
