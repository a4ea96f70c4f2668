"""The agent's SSE parser against the WHATWG event-stream rules, fed in awkward chunks."""

import pytest

from worker_agent.sse import SSEParser


def feed_all(chunks):
    parser = SSEParser()
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return parser, events


def test_typed_event_with_id_and_json():
    parser, events = feed_all([b'event: job_submit\nid: worker-w_1:7\ndata: {"type": "job_submit", "job_id": "j_1"}\n\n'])
    assert len(events) == 1
    event = events[0]
    assert (event.type, event.id) == ("job_submit", "worker-w_1:7")
    assert event.json() == {"type": "job_submit", "job_id": "j_1"}
    assert parser.last_event_id == "worker-w_1:7"


def test_multi_line_data_joins_with_newlines():
    _, events = feed_all([b"data: first\ndata: second\ndata:third\n\n"])
    assert events[0].data == "first\nsecond\nthird"
    assert events[0].type == "message"


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending(newline):
    raw = newline.join([b"event: ping", b'data: {"type": "ping"}', b"", b""])
    # a CR at the very end could be half of a CRLF: the next bytes (here a comment) settle it
    _, events = feed_all([raw, b": keep-alive"])
    assert [e.type for e in events] == ["ping"]


def test_byte_at_a_time_including_split_crlf_and_utf8():
    raw = 'id: 5\r\ndata: {"name": "gp\u00fc-w\u00f6rker"}\r\n\r\n'.encode()
    _, events = feed_all([raw[i : i + 1] for i in range(len(raw))])
    assert len(events) == 1
    assert events[0].json() == {"name": "gp\u00fc-w\u00f6rker"}
    assert events[0].id == "5"


def test_comments_padding_and_empty_events_are_not_dispatched():
    _, events = feed_all([b": " + b" " * 2048 + b"\n\n", b"event: keep-alive\n\n", b"id: 9\n\n"])
    assert events == []


def test_id_persists_and_applies_without_data():
    parser, events = feed_all([b"id: 1\ndata: a\n\n", b"data: b\n\n", b"id: 3\n\n", b"data: c\n\n"])
    assert [e.id for e in events] == ["1", "1", "3"]
    assert parser.last_event_id == "3"


def test_id_with_nul_is_ignored_and_retry_is_read():
    parser, events = feed_all([b"id: 1\ndata: a\n\n", b"id: bad\x00id\nretry: 2500\ndata: b\n\n"])
    assert [e.id for e in events] == ["1", "1"]
    assert parser.retry_ms == 2500


def test_incomplete_event_waits_for_blank_line():
    parser = SSEParser()
    assert parser.feed(b"data: partial") == []
    assert parser.feed(b"\n") == []
    assert [e.data for e in parser.feed(b"\n")] == ["partial"]


def test_field_without_colon_and_space_handling():
    _, events = feed_all([b"data\ndata:  two spaces\n\n"])
    assert events[0].data == "\n two spaces"


def test_leading_bom_is_dropped():
    _, events = feed_all([b"\xef\xbb\xbfdata: x\n\n"])
    assert events[0].data == "x"


def test_non_json_data():
    _, events = feed_all([b"data: not json\n\n"])
    assert events[0].json() is None
