"""The harness's SSE parser, fed canned chunks: what the protocol tests conclude rests on it."""

import threading

import pytest

from .harness import SSEClient

pytestmark = pytest.mark.e2e


class CannedResponse:
    """Stands in for a streamed requests response: yields ``chunks``, then (unless held open) ends."""

    status_code = 200

    def __init__(self, chunks, *, hold_open=False):
        self.chunks = chunks
        self.release = threading.Event()
        if not hold_open:
            self.release.set()
        self.raw = None

    def iter_content(self, chunk_size=None):
        yield from self.chunks
        self.release.wait(10)

    def close(self):
        self.release.set()


def read_all(chunks):
    client = SSEClient(CannedResponse(chunks)).start()
    assert client.wait_closed(timeout=5) == "server closed the stream"
    return client


def test_parses_fields_comments_multiline_data_and_ids_per_the_sse_rules():
    client = read_all(
        [
            b":" + b" " * 2048 + b"\n\n",
            b"event: stream-open\ndata:\n\n",
            b'event: job_submit\nid: worker-w_1:1\ndata: {"type":',
            b' "job_submit", "name": "caf\xc3',  # a UTF-8 character split across chunks
            b'\xa9"}\n\n',
            b"data: line one\r\ndata: line two\r",  # CRLF, then a CR whose LF may follow in the next chunk
            b"\n\r\n",
            b"id: worker-w_1:2\nevent: drain\n\n",  # no data: not dispatched, but the id is kept
            b"data:x\rretry: 5\n\n",
            b"event: partial\ndata: never finished",  # discarded at end of stream
        ]
    )
    events = client.received()
    assert [(e.type, e.data, e.id, e.own_id) for e in events] == [
        ("stream-open", "", None, False),
        ("job_submit", '{"type": "job_submit", "name": "café"}', "worker-w_1:1", True),
        ("message", "line one\nline two", "worker-w_1:1", False),
        ("message", "x", "worker-w_1:2", False),
    ]
    assert events[1].json() == {"type": "job_submit", "name": "café"}
    assert client.comments == 1
    assert client.last_event_id == "worker-w_1:2"
    assert "data: line two" in client.lines


def test_wait_for_skips_returned_events_and_fails_fast_once_the_stream_ended():
    client = read_all([b"event: a\ndata: 1\n\nevent: b\ndata: 2\n\nevent: a\ndata: 3\n\n"])
    assert client.wait_for("a").data == "1"
    assert client.wait_for("a").data == "3"
    assert client.wait_for().data == "2"
    with pytest.raises(AssertionError, match="stream ended"):
        client.wait_for("a", timeout=30)
    with pytest.raises(AssertionError, match="unexpected event"):
        client.assert_no_event("b", within=0.1)


def test_wait_for_times_out_on_an_open_stream_and_close_ends_it():
    client = SSEClient(CannedResponse([b"event: a\ndata: 1\n\n"], hold_open=True)).start()
    client.wait_for("a")
    with pytest.raises(AssertionError, match="no b within 0.2s; stream still open"):
        client.wait_for("b", timeout=0.2)
    client.assert_no_event("b", within=0.2)
    client.close()
    assert client.wait_closed(timeout=5) == "closed by client"
