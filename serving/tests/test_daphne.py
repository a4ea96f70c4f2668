"""The request body reaches the application from daphne's spool file, never held whole in the queue."""

import asyncio
import tempfile

from serving.daphne import READ_BYTES, SpooledBodyQueue


def feed_like_daphne(queue, content, buffer_size=8192):
    """daphne's loop (http_protocol.WebRequest.process): read the spool file to its end, putting every chunk."""
    content.seek(0)
    while True:
        chunk = content.read(buffer_size)
        more_body = not (len(chunk) < buffer_size)
        queue.put_nowait({"type": "http.request", "body": chunk, "more_body": more_body})
        if not more_body:
            break


def drain(queue):
    async def run():
        messages = []
        while True:
            message = await queue.get()
            messages.append(message)
            if message["type"] != "http.request" or not message["more_body"]:
                return messages

    return asyncio.run(run())


def spool(data):
    content = tempfile.TemporaryFile()
    content.write(data)
    return content


def test_the_body_arrives_whole_and_in_order_while_the_queue_holds_one_span():
    data = bytes(range(256)) * 20000  # 5 MB, not a multiple of daphne's 8 KB chunks
    content = spool(data)
    queue = SpooledBodyQueue(content)

    feed_like_daphne(queue, content)

    assert len(queue._items) == 1  # one span of the file, not 600 chunks of bytes
    messages = drain(queue)
    assert b"".join(m["body"] for m in messages) == data
    assert all(len(m["body"]) <= READ_BYTES for m in messages)
    assert [m["more_body"] for m in messages] == [True] * (len(messages) - 1) + [False]


def test_an_empty_body_and_a_disconnect_pass_through():
    content = spool(b"")
    queue = SpooledBodyQueue(content)
    feed_like_daphne(queue, content)
    assert drain(queue) == [{"type": "http.request", "body": b"", "more_body": False}]

    queue.put_nowait({"type": "http.disconnect"})
    assert asyncio.run(queue.get()) == {"type": "http.disconnect"}


def test_a_closed_spool_file_reads_as_a_disconnect():
    content = spool(b"x" * 100000)
    queue = SpooledBodyQueue(content)
    feed_like_daphne(queue, content)
    content.close()  # Twisted closes it when the connection is lost
    assert asyncio.run(queue.get()) == {"type": "http.disconnect"}


def test_a_waiting_reader_is_woken_by_the_first_chunk():
    content = spool(b"hello")

    async def run():
        queue = SpooledBodyQueue(content)
        reader = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        feed_like_daphne(queue, content)
        return await asyncio.wait_for(reader, 5)

    assert asyncio.run(run()) == {"type": "http.request", "body": b"hello", "more_body": False}


def test_the_server_freezes_its_start_up_heap_and_collects_young_objects_less_often():
    import gc

    from serving.daphne import GC_THRESHOLDS, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def connected_request():
    """A Twisted HTTPChannel on a test transport, and a request on it (daphne's WebRequest is one)."""
    from twisted.internet.testing import StringTransport
    from twisted.web.http import HTTPChannel, Request

    channel = HTTPChannel()
    channel.makeConnection(StringTransport())
    return channel, Request(channel)


def test_a_response_goes_on_at_once_while_its_connection_takes_it():
    from serving.daphne import transport_drained

    _, request = connected_request()

    asyncio.run(asyncio.wait_for(transport_drained(request), 1))

    assert request.producer is None  # nothing registered when nothing waits


def test_a_response_waits_while_its_connections_send_buffer_is_full_and_goes_on_when_it_drains():
    from serving.daphne import _Drain, transport_drained

    channel, request = connected_request()
    channel.pauseProducing()  # what the transport does when its send buffer passes its limit

    async def run():
        waiting = asyncio.create_task(transport_drained(request))
        await asyncio.sleep(0)  # one turn: the task runs up to its wait
        assert not waiting.done() and isinstance(request.producer, _Drain)
        channel.resumeProducing()  # the buffer drained
        await asyncio.wait_for(waiting, 1)

    asyncio.run(run())
    assert request.producer is None


def test_a_response_waiting_on_a_lost_connection_goes_on():
    from serving.daphne import transport_drained

    channel, request = connected_request()
    channel.pauseProducing()

    async def run():
        waiting = asyncio.create_task(transport_drained(request))
        await asyncio.sleep(0)  # one turn: the task runs up to its wait
        channel.stopProducing()  # the connection is going away
        await asyncio.wait_for(waiting, 1)

    asyncio.run(run())


def test_requests_in_flight_are_cancelled_only_once_the_before_stopping_hooks_have_returned(monkeypatch, caplog):
    """`simpletuner server` stops its local worker before daphne cancels what is in flight: the agent's
    registration, report and goodbye are answered, not cut off (daphne's own shutdown triggers run side by
    side). A hook that fails is logged and the server stops all the same."""
    from twisted.internet import defer, threads

    from serving.daphne import SpooledBodyServer

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        in_flight = loop.create_future()
        seen = []

        def failing():
            raise RuntimeError("the agent would not stop")

        server = SpooledBodyServer(
            application=None, endpoints=["tcp:port=0"], before_stopping=[lambda: seen.append(in_flight.cancelled()), failing]
        )
        server.connections = {object(): {"application_instance": in_flight}}
        monkeypatch.setattr(threads, "deferToThread", defer.maybeDeferred)  # the hooks' threads, run inline
        server.kill_all_applications()
        assert seen == [False]  # still in flight while the first hook ran
        assert in_flight.cancelled()
        assert "the agent would not stop" in caplog.text
    finally:
        loop.close()
        asyncio.set_event_loop(None)
