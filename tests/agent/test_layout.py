"""A job's own directories: the output and every cache of its config and dataloader are under its job directory."""

import json
import os
import sys

from worker_agent.layout import own_config, own_dataloader
from worker_agent.runner import JobRun

# As ../shared/realtrain/make_tiny.py writes them for SimpleTuner (absolute paths of a shared folder).
TINY_CONFIG = {
    "--model_family": "sdxl",
    "--output_dir": "/data/tiny/output",
    "--data_backend_config": "/data/tiny/config/multidatabackend.json",
    "--max_train_steps": 6,
}
TINY_DATALOADER = [
    {"id": "tiny-images", "type": "local", "dataset_type": "image", "instance_data_dir": "/data/tiny/data", "cache_dir_vae": "/data/tiny/cache/vae"},
    {"id": "tiny-text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True, "cache_dir": "/data/tiny/cache/text"},
]


def test_the_output_and_the_configs_caches_are_the_jobs_whatever_it_says(tmp_path):
    job = tmp_path / "j_1"
    config = {**TINY_CONFIG, "--cache_dir": "/shared/cache", "--cache_dir_text": "../text", "--cache_dir_vae": "/shared/vae"}
    owned = own_config(config, job)
    assert owned["--output_dir"] == str(job / "output")
    assert (owned["--cache_dir"], owned["--cache_dir_text"], owned["--cache_dir_vae"]) == (
        str(job / "cache"),
        str(job / "cache" / "text"),
        str(job / "cache" / "vae"),
    )
    assert owned["--model_family"] == "sdxl" and config["--output_dir"] == "/data/tiny/output"  # a copy
    # no output_dir at all: one is named, in the config's own style; caches it leaves to their defaults stay unnamed
    assert own_config({"max_train_steps": 3}, job) == {"max_train_steps": 3, "output_dir": str(job / "output")}
    assert own_config({"--seed": 1}, job) == {"--seed": 1, "--output_dir": str(job / "output")}


def test_each_dataset_caches_under_the_job_by_kind_and_id(tmp_path):
    job = tmp_path / "j_1"
    owned = own_dataloader(TINY_DATALOADER, job)
    assert owned[0]["cache_dir_vae"] == str(job / "cache" / "vae" / "tiny-images")
    assert owned[0]["instance_data_dir"] == "/data/tiny/data"  # the data is not a cache
    assert owned[1]["cache_dir"] == str(job / "cache" / "text_embeds" / "tiny-text-embeds")
    assert TINY_DATALOADER[0]["cache_dir_vae"] == "/data/tiny/cache/vae"  # a copy


def test_every_cache_key_of_an_entry_is_moved_and_ids_become_distinct_safe_names(tmp_path):
    job = tmp_path / "j"
    entries = [
        {"id": "../../etc", "type": "csv", "csv_cache_dir": "/tmp/csv", "cache_dir_vae": "/tmp/vae"},
        {"id": ".._.._etc", "type": "local", "cache_dir_conditioning_image_embeds": "/tmp/cond", "audio": {"cache_dir": "/tmp/a", "x": 1}},
        {"type": "webshart", "cache_dir": "/tmp/w", "webshart": {"cache_dir": "/tmp/ws", "shard_cache_gb": 0}},
        {"id": "hf", "type": "huggingface", "huggingface": {"cache_dir": "/hf-downloads"}},
        "not an entry",
    ]
    owned = own_dataloader(entries, job)
    assert owned[0]["csv_cache_dir"] == str(job / "cache" / "csv" / "etc")
    assert owned[0]["cache_dir_vae"] == str(job / "cache" / "vae" / "etc")
    assert owned[1]["cache_dir_conditioning_image_embeds"] == str(job / "cache" / "conditioning_image_embeds" / "etc-2")
    assert owned[1]["audio"] == {"cache_dir": str(job / "cache" / "audio" / "etc-2"), "x": 1}
    assert owned[2]["cache_dir"] == str(job / "cache" / "webshart" / "dataset-2")
    assert owned[2]["webshart"] == {"cache_dir": str(job / "cache" / "webshart" / "dataset-2"), "shard_cache_gb": 0}
    assert owned[3]["huggingface"] == {"cache_dir": "/hf-downloads"}  # a download cache of the dataset itself, shared on purpose
    assert owned[4] == "not an entry"
    for entry in owned[:3]:
        for value in json.dumps(entry).split('"'):
            if value.startswith("/") and "cache" in value:
                assert os.path.realpath(value).startswith(str(job)), value
    assert own_dataloader({"id": "one", "cache_dir_vae": "/x"}, job) == {"id": "one", "cache_dir_vae": str(job / "cache" / "vae" / "one")}
    assert own_dataloader("a path", job) == "a path"


def run_prepared(tmp_path, config, dataloader=None):
    run = JobRun(
        job_id="j_1", attempt="a_1", config=config, dataloader=dataloader, work_dir=tmp_path / "jobs",
        command=[sys.executable, "-c", "pass"], on_exit=lambda run: None,
    )  # fmt: skip
    return run, run.prepare()


def test_two_jobs_with_one_stored_config_share_no_directory(tmp_path):
    runs = []
    for job_id in ("j_1", "j_2"):
        run = JobRun(
            job_id=job_id, attempt="a", config=TINY_CONFIG, dataloader=TINY_DATALOADER, work_dir=tmp_path / "jobs",
            command=[sys.executable, "-c", "pass"], on_exit=lambda run: None,
        )  # fmt: skip
        config = json.loads(run.prepare().read_text())
        loader = json.loads((run.job_dir / "multidatabackend.json").read_text())
        paths = {config["--output_dir"], *(entry.get("cache_dir") or entry.get("cache_dir_vae") for entry in loader)}
        assert all(path.startswith(str(run.job_dir) + os.sep) for path in paths), paths
        assert config["--data_backend_config"] == str(run.job_dir / "multidatabackend.json")
        assert run.output_dir() == run.job_dir / "output" and run.output_dir().is_dir()
        runs.append(paths)
    assert not runs[0] & runs[1]


def test_a_dataloader_file_the_config_names_is_read_and_written_as_the_jobs_own(tmp_path):
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps(TINY_DATALOADER))
    run, config_path = run_prepared(tmp_path, {**TINY_CONFIG, "--data_backend_config": str(shared)})
    config = json.loads(config_path.read_text())
    assert config["--data_backend_config"] == str(run.job_dir / "multidatabackend.json")
    loader = json.loads((run.job_dir / "multidatabackend.json").read_text())
    assert loader[0]["cache_dir_vae"] == str(run.job_dir / "cache" / "vae" / "tiny-images")
    assert json.loads(shared.read_text()) == TINY_DATALOADER  # the user's file is untouched
    # a file that is not there is left named as it is (the trainer says what is wrong)
    run, config_path = run_prepared(tmp_path, {**TINY_CONFIG, "--data_backend_config": "/nowhere.json"})
    assert json.loads(config_path.read_text())["--data_backend_config"] == "/nowhere.json"


def test_the_config_written_is_private_to_the_agents_user(tmp_path):
    _, config_path = run_prepared(tmp_path, {"max_train_steps": 1})
    assert config_path.stat().st_mode & 0o077 == 0
