"""The calibration loader: shipped sets, user files and clear errors."""

import json

import pytest

from lukv_cache.errors import CalibrationFormatError, ConfigurationError, UnknownNameError
from lukv_cache.profiling.calibration import load_calibration, shipped_calibrations


def _write(path, rows):
    path.write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8"
    )
    return path


def test_shipped_sets_load_by_name():
    assert {"default", "expository"} <= set(shipped_calibrations())
    context, questions, description = load_calibration("default")
    assert len(context) > 10_000 and len(questions) == 30 and description.startswith("default.jsonl")


def test_user_file_with_only_required_fields_loads(tmp_path):
    path = _write(
        tmp_path / "c.jsonl", [{"type": "context", "text": "A text."}, {"type": "question", "text": "Q?"}]
    )
    assert load_calibration(path) == ("A text.", ["Q?"], "c.jsonl: 1 questions")


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "empty"),
        ([{"type": "context", "text": "A"}], "no questions"),
        ([{"type": "question", "text": "Q?"}], "first line"),
        ([{"type": "context", "text": "A"}, {"type": "context", "text": "B"}], "after the first"),
        ([{"type": "context", "text": "A"}, {"type": "question", "text": "  "}], "non-empty"),
        ([{"type": "context", "text": "A"}, '{"type": "question", "text": '], "line 2: not valid JSON"),
        ([{"type": "context", "text": "A"}, "[1, 2]"], "JSON object"),
    ],
)
def test_malformed_file_raises_calibration_format_error(tmp_path, rows, message):
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(CalibrationFormatError, match=message):
        load_calibration(path)


def test_unknown_name_lists_the_shipped_sets():
    with pytest.raises(UnknownNameError, match="default"):
        load_calibration("nonexistent")


def test_missing_file_raises_configuration_error(tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        load_calibration(tmp_path / "missing.jsonl")


def test_planted_set_asks_back_each_planted_fact_once_and_matches_its_generator(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    from lukv_cache.evaluation.tasks.samples import NEEDLE
    from lukv_cache.profiling.calibration import calibration_path

    context, questions, _ = load_calibration("planted")
    default_context, _, _ = load_calibration("default")
    rows = [json.loads(line) for line in calibration_path("planted").read_text().splitlines()]
    answers = [r["answer"] for r in rows[1:]]
    assert len(questions) == len(set(answers)) == 24
    for question, answer in zip(questions, answers):
        key = question.removeprefix("What is the locker code for the ").removesuffix("?")
        assert context.count(f"the locker code for the {key} is {answer}.") == 1
    # the narrative itself is untouched, and the wording is not the benchmark's needle
    assert context.replace("\n\n", " ").count(" ") > default_context.replace("\n\n", " ").count(" ")
    assert all(p in context for p in default_context.split("\n\n"))
    assert NEEDLE.split("{")[0].strip() not in context
    # the shipped file is what the ablation script generates (only the description was written by hand)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_ablation.py"
    monkeypatch.syspath_prepend(str(script.parent))  # its sibling helpers (_smoke, _out), as when it runs
    spec = importlib.util.spec_from_file_location("profile_ablation", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = load_calibration(module.planted_facts(str(tmp_path / "p.jsonl")))
    assert generated[:2] == (context, questions)
