"""The agent's artifact transfers: uploads resume and retry, refusals are final, downloads are checked."""

import hashlib
import json

import pytest
import requests

from worker_agent import protocol
from worker_agent.artifacts import ArtifactTransfer, TransferError

from .fakes import FakeResponse, FakeSession


class Body(FakeResponse):
    """A download's streamed body."""

    def __init__(self, data, status=200):
        super().__init__(status)
        self.data = data

    def iter_content(self, size):
        for start in range(0, len(self.data), size):
            yield self.data[start : start + size]


def transfer(*script):
    session = FakeSession(*script)
    delays = []
    return ArtifactTransfer(
        base_url="http://orch:8001", upload_endpoint=protocol.UPLOAD_PATH, token="stu_t", session=session, sleep=delays.append
    ), session, delays


def stored(data):
    return FakeResponse(201, {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})


def test_the_output_directory_is_uploaded_file_by_file_and_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "output"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "model.bin").write_bytes(b"model")
    (out / "checkpoint-5" / "state.json").write_bytes(b"state")
    manifest = tmp_path / "uploaded.json"
    refused = FakeResponse(413, {"code": protocol.QUOTA_EXCEEDED, "detail": "quota"}, reason="Payload Too Large")
    first, session, _ = transfer(stored(b"state"), refused)

    with pytest.raises(TransferError) as raised:
        first.upload_dir(out, manifest_path=manifest)  # the second file is refused: final, not retried

    assert raised.value.status == 413 and raised.value.code == protocol.QUOTA_EXCEEDED
    assert [c["url"] for c in session.calls] == [
        "http://orch:8001/api/cloud/storage/output/checkpoint-5/state.json",
        "http://orch:8001/api/cloud/storage/output/model.bin",
    ]
    assert session.calls[0]["headers"][protocol.UPLOAD_TOKEN_HEADER] == "stu_t"
    second, session, _ = transfer(stored(b"model"))
    assert second.upload_dir(out, manifest_path=manifest) == 1  # only what was not stored yet
    assert [c["url"] for c in session.calls] == ["http://orch:8001/api/cloud/storage/output/model.bin"]
    assert set(json.loads(manifest.read_text())) == {"checkpoint-5/state.json", "model.bin"}


def test_transient_failures_are_retried_with_backoff_and_retry_after(tmp_path):
    (tmp_path / "f").write_bytes(b"data")
    busy = FakeResponse(429, {"detail": "slow down"}, headers={"Retry-After": "7"})
    down = FakeResponse(503, {"detail": "restarting"})
    uploader, session, delays = transfer(requests.ConnectionError("refused"), busy, down, stored(b"data"))

    assert uploader.upload_file(tmp_path / "f", "output", "f")["size"] == 4

    assert len(session.calls) == 4 and len(delays) == 3
    assert delays[1] >= 7


def test_a_stale_token_is_final(tmp_path):
    (tmp_path / "f").write_bytes(b"data")
    uploader, session, delays = transfer(FakeResponse(409, {"code": protocol.STALE_ATTEMPT, "detail": "dead"}))
    with pytest.raises(TransferError) as raised:
        uploader.upload_file(tmp_path / "f", "output", "f")
    assert raised.value.code == protocol.STALE_ATTEMPT and len(session.calls) == 1 and delays == []


def resume_of(data):
    return {
        "step": 20,
        "checkpoint": "checkpoint-20",
        "attempt": 1,
        "files": [
            {
                "key": "output/checkpoint-20/state.json",
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "download_url": "/api/cloud/storage/output/checkpoint-20/state.json",
            }
        ],
    }


def test_a_checkpoint_is_downloaded_into_the_output_directory_and_checked(tmp_path):
    data = b'{"step": 20}' * 100000
    downloader, session, _ = transfer(Body(data))

    directory = downloader.download_checkpoint(resume_of(data), tmp_path / "out", manifest_path=tmp_path / "m.json")

    assert directory == tmp_path / "out" / "checkpoint-20"
    assert (directory / "state.json").read_bytes() == data
    assert session.calls[0]["url"] == "http://orch:8001/api/cloud/storage/output/checkpoint-20/state.json"
    assert "checkpoint-20/state.json" in json.loads((tmp_path / "m.json").read_text())  # not uploaded back


def test_a_corrupt_download_is_refused_and_leaves_nothing(tmp_path):
    downloader, _, _ = transfer(Body(b"tampered"))
    with pytest.raises(TransferError, match="does not match"):
        downloader.download_checkpoint(resume_of(b"original"), tmp_path / "out")
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []
