"""URL patterns from the wire protocol's paths, so the paths are spelled once (``worker_agent.protocol``)."""

import re

from django.urls import re_path


def protocol_route(path, view, *, name):
    """Route the absolute ``path`` (``{name}`` placeholders become word segments), with or without a trailing slash."""
    pattern = re.escape(path.lstrip("/"))
    pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[\\w-]+)", pattern)
    return re_path(f"^{pattern}/?$", view, name=name)
