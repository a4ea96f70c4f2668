"""The stream view's rewrites of the library's own events, so every data line carries a type."""

import json

from realtime.streams import sse_shutdown, typed_stream_reset


def _data(text):
    return json.loads(next(line[6:] for line in text.splitlines() if line.startswith("data: ")))


def test_stream_reset_gets_a_type_and_keeps_its_fields():
    chunk = 'event: stream-reset\nid: worker-w_1:7\ndata: {"channels": ["worker-w_1"]}\n\nevent: drain\ndata: {"type": "drain"}\n\n'
    rewritten = typed_stream_reset(chunk)
    assert _data(rewritten) == {"type": "stream-reset", "channels": ["worker-w_1"]}
    assert rewritten.endswith('event: drain\ndata: {"type": "drain"}\n\n')


def test_other_chunks_pass_through_unchanged():
    chunk = 'event: job_submit\nid: worker-w_1:1\ndata: {"type": "job_submit"}\n\n'
    assert typed_stream_reset(chunk) is chunk


def test_shutdown_event_names_the_reason_and_its_code():
    text = sse_shutdown("token rotated", "token_revoked")
    assert text.startswith("event: shutdown\n")
    assert _data(text) == {"type": "shutdown", "reason": "token rotated", "code": "token_revoked"}
