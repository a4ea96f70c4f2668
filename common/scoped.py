"""A context variable's value for the length of a ``with`` block."""

from contextlib import contextmanager


@contextmanager
def bound(var, value):
    """Set the ``ContextVar`` ``var`` to ``value`` inside the block; its previous value comes back after it, however it ends."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
