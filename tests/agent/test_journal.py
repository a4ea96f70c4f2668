"""The outcome journal: written whole or not at all, found again at start-up, marked once answered."""

import json
import os

import pytest

from worker_agent import journal


def test_write_is_complete_and_leaves_no_temp_file(tmp_path):
    report = {"status": "completed", "attempt": "a_1", "exit_code": 0, "error": None, "progress": {"step": 3}, "log_tail": "x"}
    path = journal.write_outcome(tmp_path / "j_1", "j_1", report)
    assert path == tmp_path / "j_1" / "outcome.json"
    record = json.loads(path.read_text())
    assert (record["job_id"], record["report"], record["version"]) == ("j_1", report, 1)
    assert sorted(os.listdir(tmp_path / "j_1")) == ["outcome.json"]


def test_a_failed_write_keeps_the_previous_file_and_no_temp(tmp_path, monkeypatch):
    journal.write_outcome(tmp_path / "j_1", "j_1", {"status": "failed", "attempt": "a_1"})

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        journal.write_outcome(tmp_path / "j_1", "j_1", {"status": "completed", "attempt": "a_2"})
    assert json.loads((tmp_path / "j_1" / "outcome.json").read_text())["report"]["attempt"] == "a_1"
    assert sorted(os.listdir(tmp_path / "j_1")) == ["outcome.json"]


def test_undelivered_lists_outcomes_oldest_first_and_skips_unreadable_ones(tmp_path):
    journal.write_outcome(tmp_path / "j_old", "j_old", {"status": "failed", "attempt": "a_1"})
    journal.write_outcome(tmp_path / "j_new", "j_new", {"status": "completed", "attempt": "a_2"})
    old = tmp_path / "j_old" / "outcome.json"
    record = json.loads(old.read_text())
    record["written_at"] -= 100
    old.write_text(json.dumps(record))
    (tmp_path / "j_bad").mkdir()
    (tmp_path / "j_bad" / "outcome.json").write_text('{"report": ')
    (tmp_path / "j_done").mkdir()
    (tmp_path / "j_done" / "outcome.reported.json").write_text("{}")
    found = journal.undelivered(tmp_path)
    assert [(entry.job_id, entry.report["attempt"]) for entry in found] == [("j_old", "a_1"), ("j_new", "a_2")]
    assert journal.undelivered(tmp_path / "missing") == []


def test_mark_delivered_renames_and_tolerates_a_missing_file(tmp_path):
    path = journal.write_outcome(tmp_path / "j_1", "j_1", {"status": "completed", "attempt": "a_1"})
    journal.mark_delivered(path)
    assert not path.exists() and (tmp_path / "j_1" / "outcome.reported.json").exists()
    assert journal.undelivered(tmp_path) == []
    journal.mark_delivered(path)  # again: nothing to do, nothing raised


def test_a_worker_is_found_again_by_its_token_and_results_of_another_worker_are_left_alone(tmp_path):
    assert journal.worker_of_token(tmp_path, "wt_a") is None
    directory = journal.remember_worker(tmp_path, "w_a", "wt_a")
    journal.remember_worker(tmp_path, "w_a", "wt_a2")  # a rotated token: both are the worker's
    assert directory == tmp_path / "w_a"
    assert "wt_a" not in (directory / "worker.json").read_text()  # digests only
    assert journal.worker_of_token(tmp_path, "wt_a") == journal.worker_of_token(tmp_path, "wt_a2") == "w_a"
    assert journal.worker_of_token(tmp_path, "wt_b") is None
    mine = journal.write_outcome(directory / "j_1", "j_1", {"status": "failed", "attempt": "a_1"}, worker_id="w_a")
    journal.write_outcome(directory / "j_2", "j_2", {"status": "failed", "attempt": "a_2"}, worker_id="w_b")
    assert [(entry.path, entry.job_id) for entry in journal.undelivered(directory, worker_id="w_a")] == [(mine, "j_1")]


@pytest.mark.parametrize("worker_id", ["..", "a/b", "", None, "x" * 65])
def test_a_worker_id_that_is_no_plain_directory_name_is_refused(tmp_path, worker_id):
    with pytest.raises(ValueError):
        journal.remember_worker(tmp_path, worker_id, "wt_a")
