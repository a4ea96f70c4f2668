"""Which keys an upload may name, and which are checkpoint files."""

import pytest

from artifacts.keys import BadKey, clean_key
from worker_agent import protocol


@pytest.mark.parametrize(
    ("bucket", "key"),
    [("", "k"), ("b", ""), ("b", "../k"), ("..", "k"), ("b", "a//k"), ("b", "a/./k"), ("b", "a\\k"), ("b", "a\x00"), ("b", "\u202ek"), ("b", "k" * 1100)],
)
def test_unsafe_keys_are_refused(bucket, key):
    with pytest.raises(BadKey):
        clean_key(bucket, key)


@pytest.mark.parametrize("segment", ["k" * 256, "é" * 128, "✓" * 86])  # 256, 256 and 258 bytes of UTF-8
def test_a_segment_over_255_bytes_is_refused_with_its_reason(segment):
    with pytest.raises(BadKey, match="at most 255 bytes"):
        clean_key("b", f"run/{segment}/model.bin")
    with pytest.raises(BadKey, match="at most 255 bytes"):
        clean_key(segment, "model.bin")


def test_a_segment_of_255_bytes_is_taken():
    assert clean_key("b", "k" * 255 + "/" + "é" * 127) == "b/" + "k" * 255 + "/" + "é" * 127


def test_a_safe_key_keeps_its_bucket():
    assert clean_key("outputs", "run-1/checkpoint-10/model.safetensors") == "outputs/run-1/checkpoint-10/model.safetensors"
    assert clean_key("b", "..hidden/x..y") == "b/..hidden/x..y"  # only a whole '..' segment climbs


@pytest.mark.parametrize(
    ("key", "step", "relative"),
    [
        ("out/checkpoint-10/model.bin", 10, "checkpoint-10/model.bin"),
        ("out/run/checkpoint-200/unet/weights.bin", 200, "checkpoint-200/unet/weights.bin"),
        ("out/checkpoint-5/checkpoint-7/x", 7, "checkpoint-7/x"),
    ],
)
def test_checkpoint_files(key, step, relative):
    assert protocol.checkpoint_step(key)[0] == step
    assert protocol.checkpoint_relative_path(key) == relative


@pytest.mark.parametrize("key", ["out/checkpoint-10", "out/checkpoint-x/m", "out/checkpoint-/m", "out/model.bin", "out/checkpoint-١/m"])
def test_not_checkpoint_files(key):
    assert protocol.checkpoint_step(key) is None
