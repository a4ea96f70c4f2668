"""Which bucket and key an upload may name: checked before a byte is stored."""

import unicodedata

from worker_agent import protocol


# A file or folder name's limit on the file systems artifacts are stored on (ext4, XFS, APFS: 255 bytes).
SEGMENT_MAX_BYTES = 255


class BadKey(ValueError):
    """The bucket or key cannot name a file in a job's namespace."""


def clean_key(bucket, key):
    """Return ``bucket/key``, the artifact's key in its job's namespace; raise BadKey for one that is unsafe.

    Refused: an empty bucket or key, an empty, ``.`` or ``..`` segment, a segment over SEGMENT_MAX_BYTES
    bytes of UTF-8, a backslash, a control or unassigned character, and more than ``protocol.KEY_MAX_CHARS``
    characters in all.
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
        size = len(segment.encode("utf-8"))
        if size > SEGMENT_MAX_BYTES:
            raise BadKey(f"a key's segment (a file or folder name) is at most {SEGMENT_MAX_BYTES} bytes of UTF-8; {segment[:40]!r}... is {size}")
    return full
