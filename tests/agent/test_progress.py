"""The progress protocol: marker lines in, normalised updates out; merging; the console line; report()."""

import io
import json

import pytest

from worker_agent.progress import MARKER, format_progress, merge, parse_line, report


class RecordingStream(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def line(fields):
    return MARKER + json.dumps(fields)


def test_the_documented_example_parses():
    example = 'SIMPLETUNER_PROGRESS {"step": 40, "total_steps": 100, "loss": 0.231, "epoch": 1, "metrics": {"accuracy": 0.91}}'
    assert parse_line(example) == {
        "step": 40,
        "total_steps": 100,
        "fraction": 0.4,
        "epoch": 1,
        "loss": 0.231,
        "metrics": {"accuracy": 0.91},
    }


def test_report_then_parse_round_trips():
    stream = RecordingStream()
    report(
        40,
        100,
        loss=0.231,
        file=stream,
        epoch=2,
        learning_rate=1e-4,
        metrics={"accuracy": 0.91},
        message="warming up",
    )
    written = stream.getvalue()
    assert written.count("\n") == 1 and written.endswith("\n")
    assert written.startswith(MARKER + "{")
    assert ", " not in written and '": ' not in written  # compact JSON
    assert stream.flushes == 1
    assert parse_line(written) == {
        "step": 40,
        "total_steps": 100,
        "fraction": 0.4,
        "epoch": 2,
        "loss": 0.231,
        "learning_rate": 1e-4,
        "metrics": {"accuracy": 0.91},
        "message": "warming up",
    }


def test_report_writes_to_stdout_by_default_and_leaves_out_unknowns(capsys):
    report(3)
    report(loss=float("nan"), metrics={"acc": float("inf"), "f1": 0.5}, epoch=None)
    out = capsys.readouterr().out.splitlines()
    assert out == [MARKER + '{"step":3}', MARKER + '{"metrics":{"f1":0.5}}']


def test_report_sends_tensor_like_scalars_as_numbers():
    class Scalar:
        """Stands in for a 0-d torch tensor or numpy scalar."""

        def __init__(self, value):
            self.value = value

        def item(self):
            return self.value

    stream = io.StringIO()
    report(Scalar(7), 10, loss=Scalar(0.5), file=stream, metrics={"acc": Scalar(0.75)})
    assert parse_line(stream.getvalue()) == {
        "step": 7,
        "total_steps": 10,
        "fraction": 0.7,
        "loss": 0.5,
        "metrics": {"acc": 0.75},
    }


def test_leading_whitespace_and_line_endings_are_allowed():
    assert parse_line('   \tSIMPLETUNER_PROGRESS {"step": 5}\r\n') == {"step": 5}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "step 40/100 loss 0.2",
        "SIMPLETUNER_PROGRESS",
        "SIMPLETUNER_PROGRESS ",
        'SIMPLETUNER_PROGRESS{"step": 1}',
        'simpletuner_progress {"step": 1}',
        'INFO SIMPLETUNER_PROGRESS {"step": 1}',
        "SIMPLETUNER_PROGRESS not json",
        'SIMPLETUNER_PROGRESS {"step": 1',
        'SIMPLETUNER_PROGRESS {"step": 1} trailing',
        "SIMPLETUNER_PROGRESS [1, 2]",
        'SIMPLETUNER_PROGRESS "step 1"',
        "SIMPLETUNER_PROGRESS 42",
        "SIMPLETUNER_PROGRESS null",
        "SIMPLETUNER_PROGRESS {}",
        'SIMPLETUNER_PROGRESS {"loss": "nan"}',
        'SIMPLETUNER_PROGRESS {"loss": NaN, "step": -1, "unknown": 1}',
        'SIMPLETUNER_PROGRESS {"step": true}',
        "SIMPLETUNER_PROGRESS " + "[" * 100_000,
        "SIMPLETUNER_PROGRESS " + '{"step": ' + "9" * 5000 + "}",
    ],
)
def test_lines_that_are_not_valid_progress_give_none(text):
    assert parse_line(text) is None


@pytest.mark.parametrize("value", [None, b'SIMPLETUNER_PROGRESS {"step": 1}', 17])
def test_a_non_string_gives_none(value):
    assert parse_line(value) is None


def test_invalid_fields_are_dropped_one_by_one():
    update = parse_line(
        line(
            {
                "step": -1,
                "total_steps": 0,
                "loss": "0.5",
                "epoch": 2,
                "learning_rate": -0.1,
                "metrics": {"bad": "x", "ok": 1, "": 2, "flag": True, "x" * 65: 3},
                "message": 5,
                "fraction": "half",
                "extra": {"ignored": True},
            }
        )
    )
    assert update == {"epoch": 2, "metrics": {"ok": 1.0}}


def test_non_finite_numbers_are_dropped():
    update = parse_line(
        'SIMPLETUNER_PROGRESS {"step": 3, "loss": NaN, "learning_rate": Infinity, "metrics": {"a": -Infinity}}'
    )
    assert update == {"step": 3}


def test_types_are_normalised():
    update = parse_line(line({"step": 40.0, "total_steps": 100.0, "loss": 1, "epoch": 1.5, "message": "  hi  "}))
    assert update == {"step": 40, "total_steps": 100, "fraction": 0.4, "loss": 1.0, "epoch": 1.5, "message": "hi"}
    assert type(update["step"]) is int and type(update["total_steps"]) is int and type(update["loss"]) is float
    assert parse_line(line({"step": 40.5})) is None


@pytest.mark.parametrize(
    "fields, fraction",
    [
        ({"fraction": 1.5}, 1.0),
        ({"fraction": -0.25}, 0.0),
        ({"fraction": 0.3}, 0.3),
        ({"step": 150, "total_steps": 100}, 1.0),
        ({"step": 0, "total_steps": 100}, 0.0),
        ({"step": 25, "total_steps": 100, "fraction": 0.9}, 0.9),  # an explicit fraction wins
    ],
)
def test_fraction_is_computed_and_clamped(fields, fraction):
    assert parse_line(line(fields))["fraction"] == fraction


def test_no_fraction_without_both_step_and_total():
    assert "fraction" not in parse_line(line({"step": 12}))
    assert "fraction" not in parse_line(line({"total_steps": 12}))


def test_message_and_metrics_are_bounded():
    update = parse_line(line({"message": "x" * 500, "metrics": {f"m{i:02}": i for i in range(50)}}))
    assert update["message"] == "x" * 200
    assert list(update["metrics"]) == [f"m{i:02}" for i in range(32)]


def test_merge_overwrites_fields_and_merges_metrics_by_name():
    first = parse_line(line({"step": 10, "total_steps": 100, "loss": 0.9, "metrics": {"acc": 0.5, "f1": 0.4}}))
    second = parse_line(line({"step": 20, "loss": 0.7, "metrics": {"acc": 0.6}}))
    before = json.dumps(first, sort_keys=True)

    merged = merge(first, second)

    assert merged == {
        "step": 20,
        "total_steps": 100,
        "fraction": 0.2,  # recomputed: the update moved step
        "loss": 0.7,
        "metrics": {"acc": 0.6, "f1": 0.4},
    }
    assert json.dumps(first, sort_keys=True) == before  # inputs untouched
    assert second == {"step": 20, "loss": 0.7, "metrics": {"acc": 0.6}}


def test_merge_keeps_an_explicit_fraction_until_something_moves_it():
    state = merge(None, parse_line(line({"fraction": 0.3})))
    assert state == {"fraction": 0.3}
    state = merge(state, parse_line(line({"loss": 0.5})))
    assert state == {"fraction": 0.3, "loss": 0.5}
    state = merge(state, parse_line(line({"total_steps": 10, "step": 6, "fraction": 0.65})))
    assert state["fraction"] == 0.65
    state = merge(state, parse_line(line({"total_steps": 20})))
    assert state["fraction"] == 0.3  # step 6 of a run that grew to 20 steps


@pytest.mark.parametrize(
    "progress, text",
    [
        ({"step": 40, "total_steps": 100, "fraction": 0.4, "loss": 0.231}, "step 40/100 (40%) loss 0.2310"),
        ({"fraction": 0.4}, "40%"),
        ({"step": 12}, "step 12"),
        ({"step": 12, "fraction": 0.29}, "step 12 (29%)"),
        ({"step": 999, "total_steps": 1000, "fraction": 0.999}, "step 999/1000 (99%)"),
        ({"step": 3, "epoch": 1, "loss": 2.5e-05}, "step 3 epoch 1 loss 2.500e-05"),
        (
            {"step": 5, "total_steps": 10, "fraction": 0.5, "learning_rate": 1e-4, "metrics": {"acc": 0.91}},
            "step 5/10 (50%) lr 1.00e-04 acc 0.9100",
        ),
        ({"loss": 0.0, "message": "saving"}, "loss 0.0000 - saving"),
        ({}, "no progress reported"),
    ],
)
def test_format_progress(progress, text):
    assert format_progress(progress) == text
