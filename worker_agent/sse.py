"""An incremental Server-Sent Events parser (the WHATWG event-stream format) over raw byte chunks."""

import codecs
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    """One dispatched SSE event: ``type`` is the ``event:`` field ("message" when absent)."""

    type: str
    data: str
    id: str | None = None

    def json(self):
        """Return ``data`` parsed as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.data)
        except ValueError:
            return None


class SSEParser:
    """Feed bytes as they arrive; get complete events back.

    Follows the specification: lines end in CRLF, LF or CR (also split across chunks); ``:`` starts a
    comment; one space after the colon is dropped; ``data`` lines join with newlines; ``id`` persists
    across events (``last_event_id``, what a reconnect sends as Last-Event-ID) and an id with NUL is
    ignored; ``retry`` sets ``retry_ms``; an event with no data is not dispatched.
    """

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._data = []
        self._type = ""
        self._id_buffer = None
        self.last_event_id = None
        self.retry_ms = None
        self._first_chunk = True

    def feed(self, chunk):
        """Parse ``chunk`` (bytes or str) and return the list of events it completed."""
        text = self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        if self._first_chunk and text:
            self._first_chunk = False
            text = text.removeprefix("\ufeff")
        buffer = self._pending + text
        events = []
        start = 0
        length = len(buffer)
        i = 0
        while i < length:
            char = buffer[i]
            if char == "\n" or char == "\r":
                if char == "\r" and i + 1 == length:
                    break  # a CR at the end may be the first half of CRLF: wait for the next chunk
                line = buffer[start:i]
                i += 2 if char == "\r" and buffer[i + 1] == "\n" else 1
                start = i
                event = self._line(line)
                if event is not None:
                    events.append(event)
                continue
            i += 1
        self._pending = buffer[start:]
        return events

    def _line(self, line):
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._type = value
        elif field == "id":
            if "\0" not in value:
                self._id_buffer = value
        elif field == "retry":
            if value.isdigit():
                self.retry_ms = int(value)
        return None

    def _dispatch(self):
        if self._id_buffer is not None:
            self.last_event_id = self._id_buffer
        data, event_type = self._data, self._type
        self._data, self._type = [], ""
        if not data:
            return None
        return Event(type=event_type or "message", data="\n".join(data), id=self.last_event_id)
