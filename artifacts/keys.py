"""Which bucket and key an upload may name: checked before a byte is stored."""

import unicodedata

from worker_agent import protocol


class BadKey(ValueError):
    """The bucket or key cannot name a file in a job's namespace."""


def clean_key(bucket, key):
    """Return ``bucket/key``, the artifact's key in its job's namespace; raise BadKey for one that is unsafe.

    Refused: an empty bucket or key, an empty, ``.`` or ``..`` segment, a backslash, a control or
    unassigned character, and more than ``protocol.KEY_MAX_CHARS`` characters in all.
    """
    full = f"{bucket}/{key}"
    if not bucket or not key:
        raise BadKey("both a bucket and a key are needed: PUT {endpoint}/{bucket}/{key}")
    if len(full) > protocol.KEY_MAX_CHARS:
        raise BadKey(f"the bucket and key are {len(full)} characters; at most {protocol.KEY_MAX_CHARS}")
    if "\\" in full:
        raise BadKey("a key may not hold a backslash")
    for char in full:
        if unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Cn"):
            raise BadKey(f"a key may not hold the character U+{ord(char):04X}")
    for segment in full.split("/"):
        if segment in ("", ".", ".."):
            raise BadKey(f"a key may not hold an empty, '.' or '..' segment: {full!r}")
    return full
