"""The artifact storage (Django's storage API: a directory under the data dir, or S3) and streaming into it.

An upload is read from the request in chunks and handed to the storage as it arrives: its SHA-256 and
size are computed on the way and it is cut off as soon as it passes its limit. Nothing holds the
whole file in memory.
"""

import hashlib
import io
import secrets
from dataclasses import dataclass

from django.core.files import File
from django.core.files.storage import storages

STORAGE_ALIAS = "artifacts"
CHUNK_BYTES = 1024 * 1024


class IncompleteUpload(Exception):
    """The storage stopped reading before the body ended, or the body ended before its Content-Length."""


class UploadTooLarge(Exception):
    """The body passed the limit it was given; nothing of it is kept."""

    def __init__(self, limit):
        super().__init__(limit)
        self.limit = limit


@dataclass(frozen=True)
class StoredFile:
    name: str  # in the artifact storage
    size: int
    sha256: str


def artifact_storage():
    """Return the storage artifacts are kept in (``STORAGES["artifacts"]``)."""
    return storages[STORAGE_ALIAS]


class HashingReader(io.RawIOBase):
    """A read-only stream over ``source`` that hashes and counts what is read, and raises UploadTooLarge past ``limit``."""

    def __init__(self, source, limit):
        super().__init__()
        self._source = source
        self._limit = limit
        self.size = 0
        self.digest = hashlib.sha256()

    def readable(self):
        return True

    def read(self, size=-1):
        """Return the next ``size`` bytes (fewer only at the end, as a file does: S3 uploads rely on it);
        ``size`` -1 reads one chunk, never the whole body."""
        if size is None or size < 0:
            size = CHUNK_BYTES
        parts, got = [], 0
        while got < size:
            data = self._source.read(min(size - got, CHUNK_BYTES)) or b""
            if not data:
                break
            self.size += len(data)
            if self.size > self._limit:
                raise UploadTooLarge(self._limit)
            self.digest.update(data)
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    def readinto(self, buffer):
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def storage_name(job_id, key):
    """Return a new name for an upload of ``key`` in ``job_id``'s namespace (unique: a replaced file is kept
    until its successor is recorded)."""
    return f"outputs/{job_id}/{secrets.token_hex(6)}/{key}"


def download_name(key):
    """Return the file name a download of the artifact ``key`` is saved under: its whole key, folders joined
    by ``_`` (``output/checkpoint-50/state.json`` -> ``output_checkpoint-50_state.json``), so the files of a
    job's checkpoints, which share their base names, do not overwrite each other in one download folder."""
    return "_".join(part for part in key.split("/") if part) or "artifact"


def file_receive(*, job_id, key, stream, limit, expected_size=None):
    """Stream ``stream`` into the artifact storage as ``key`` of ``job_id``; return the StoredFile.

    Raise UploadTooLarge once more than ``limit`` bytes arrive, IncompleteUpload when the storage did
    not read the body to its end or the body is not ``expected_size`` bytes; nothing is kept then.
    """
    storage = artifact_storage()
    reader = HashingReader(stream, limit)
    wanted = storage_name(job_id, key)
    try:
        name = storage.save(wanted, File(reader, name=key.rsplit("/", 1)[-1]))
        if reader.read(1):  # whatever the backend did, what it stored must be the whole body
            raise IncompleteUpload(f"the storage stopped reading after {reader.size - 1} bytes")
        if expected_size is not None and reader.size != expected_size:
            raise IncompleteUpload(f"the body was {reader.size} bytes, not the {expected_size} its Content-Length said")
    except BaseException:
        file_delete(wanted)
        raise
    return StoredFile(name=name, size=reader.size, sha256=reader.digest.hexdigest())


def file_delete(name):
    """Remove ``name`` from the artifact storage; one already gone is fine."""
    storage = artifact_storage()
    try:
        storage.delete(name)
    except FileNotFoundError:
        pass


def file_open(name):
    """Return ``name`` opened for reading from the artifact storage (read it in chunks)."""
    return artifact_storage().open(name, "rb")
