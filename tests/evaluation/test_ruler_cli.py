"""``lukv ruler`` end to end on a tiny random model (2 tasks x 1 sample), resumed; its refusals; the results
file. Skipped without RULER's optional packages (CI installs them)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.evaluation.ruler.deps import INSTALL, check_dependencies, needed_modules
from lukv_cache.evaluation.ruler.store import Store

TASKS = ["niah_single_1", "fwe"]
MISSING = [m for m in needed_modules(TASKS) if importlib.util.find_spec(m) is None]
needs_ruler = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: {INSTALL}")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from lukv_cache.testing import BYTE_VOCAB, byte_tokenizer, tiny_model

    folder = tmp_path_factory.mktemp("tiny_ruler")
    model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=2, max_position_embeddings=8192)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _args(folder, out, *extra):
    return [
        "ruler", str(folder), "--lengths", "4096", "--tasks", *TASKS, "--samples", "1", "--scorers", "keydiff",
        "--allocators", "uniform", "--ratios", "0.5", "--threads", "1", "--quiet", "--out", str(out), "--name", "t",
        *extra,
    ]  # fmt: skip


@needs_ruler
def test_ruler_runs_end_to_end_and_resumes(tiny_folder, tmp_path, capsys):
    assert main(_args(tiny_folder, tmp_path)) == 0
    printed = capsys.readouterr().out
    assert "### RULER at 4096 tokens" in printed and "uniform/keydiff@0.5" in printed
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "run" and lines[0]["seed"] == 42
    records = lines[1:]
    assert sorted((r["task"], r["method"]) for r in records) == sorted(
        (t, m) for t in TASKS for m in ("full", "uniform/keydiff@0.5")
    )
    for r in records:
        assert 0.0 <= r["score"] <= 100.0 and r["context_tokens"] > 1000
    report = json.loads((tmp_path / "t.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["full"]["kv_fraction"] == pytest.approx(1.0)
    assert 0.3 < rows["uniform/keydiff@0.5"]["kv_fraction"] < 0.75
    assert set(rows["full"]["tasks"]) == set(TASKS)
    assert (tmp_path / "t.md").read_text().count("| uniform/keydiff@0.5 |") == 1
    samples = tmp_path / "t.samples" / "seed42" / "4096" / "fwe.jsonl"
    assert set(json.loads(samples.read_text().splitlines()[0])) >= {
        "context",
        "question",
        "answer_prefix",
        "answer",
    }
    # a rerun runs nothing already done; a new ratio runs only its own samples
    assert main(_args(tiny_folder, tmp_path)) == 0
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 1 + len(records)
    assert main(_args(tiny_folder, tmp_path, "--ratios", "0.8")) == 0
    methods = [json.loads(x).get("method") for x in (tmp_path / "t.jsonl").read_text().splitlines()[1:]]
    assert methods.count("uniform/keydiff@0.8") == 2 and methods.count("full") == 2


@needs_ruler
def test_a_length_beyond_the_models_positions_is_refused_before_it_loads(tiny_folder, tmp_path, capsys):
    code = main(_args(tiny_folder, tmp_path, "--lengths", "16384"))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --lengths 16384") and "8192" in err
    assert not (tmp_path / "t.jsonl").exists()


def test_unknown_task_and_short_length_are_one_error_line(tmp_path, capsys):
    assert main(["ruler", "smollm2", "--tasks", "niah_single_9", "--out", str(tmp_path)]) == 2
    assert "Unknown RULER task 'niah_single_9'" in capsys.readouterr().err
    assert main(["ruler", "smollm2", "--lengths", "100", "--out", str(tmp_path)]) == 2
    assert "--lengths" in capsys.readouterr().err


def test_a_missing_optional_package_is_one_line_saying_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wonderwords" else real(name, *a)
    )
    with pytest.raises(ConfigurationError) as info:
        check_dependencies(["cwe"])
    message = str(info.value)
    assert "wonderwords" in message and "pip install" in message and "\n" not in message


def test_the_results_file_drops_a_cut_line_and_refuses_another_model(tmp_path):
    path = tmp_path / "r.jsonl"
    store = Store(path, {"model": "a", "seed": 42})
    record = {"length": 1024, "task": "vt", "index": 0, "method": "full", "score": 100.0}
    store.append(record)
    with open(path, "a") as handle:
        handle.write('{"kind": "sample", "length": 10')  # a run killed mid-line
    again = Store(path, {"model": "a", "seed": 42})
    assert again.done == {(1024, "vt", 0, "full")}
    assert path.read_text().endswith("\n")
    with pytest.raises(ConfigurationError, match="holds a run of 'a'"):
        Store(path, {"model": "b", "seed": 42})
