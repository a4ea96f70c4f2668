"""Reading a download in a test: its body is an async iterator (what ASGI streams without reading it whole first)."""

from asgiref.sync import async_to_sync


def downloaded(response):
    """The whole body of the streamed download ``response``; fail if it is not read chunk by chunk asynchronously."""
    assert response.is_async, "a download must stream from an async iterator (Django reads a sync one whole under ASGI)"

    async def body():
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(body)()
