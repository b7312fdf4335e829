"""``lukv ruler``'s picture: score against ratio, one line per method, a memory budget at the ratio its bytes
amount to, kvpress's results beside ours; written with the tables."""

from __future__ import annotations

import json

import pytest

from lukv_cache.cli import main
from lukv_cache.evaluation.ruler.leaderboard import curves
from lukv_cache.evaluation.ruler.report import summarize, write_report


def _record(method, task, index, score, kv_bytes, full=1000):
    return {
        "kind": "sample", "length": 1024, "task": task, "index": index, "method": method, "score": score,
        "kv_bytes": kv_bytes, "full_kv_bytes": full,
    }  # fmt: skip


RECORDS = [
    *(_record("full", t, i, 100.0, 1000) for t in ("vt", "cwe") for i in range(2)),
    *(_record("global/kvzap@0.8", t, i, 50.0 * i, 200) for t in ("vt", "cwe") for i in range(2)),
    *(_record("global/kvzap@0.5", t, i, 100.0, 500) for t in ("vt", "cwe") for i in range(2)),
    *(_record("global/kvzap@mem0.1", t, i, 100.0, 100) for t in ("vt", "cwe") for i in range(2)),
    *(_record("kvpress:snapkv@0.8", t, i, 0.0, 1000) for t in ("vt", "cwe") for i in range(2)),
    *(_record("global/kvzap@0.8/int4", t, i, 100.0, 60) for t in ("vt", "cwe") for i in range(2)),
]


def test_each_method_is_a_line_and_a_budget_a_point_at_its_bytes():
    got = curves(summarize(RECORDS), 1024)
    assert got["full"] == [(0.0, 100.0, 0.0)]
    assert [x for x, _, _ in got["global/kvzap"]] == [0.5, 0.8]
    assert got["global/kvzap"][1][1] == pytest.approx(25.0)  # 0 and 50 on each task
    assert got["global/kvzap/int4"] == [(0.8, 100.0, 0.0)]  # its own line, not mixed with fp32's
    assert got["global/kvzap memory=0.1"] == [(0.9, 100.0, 0.0)]  # 100 of 1000 bytes held
    assert got["kvpress:snapkv"] == [(0.8, 0.0, 0.0)]
    assert curves(summarize(RECORDS), 4096) == {}


def test_the_report_writes_the_picture_beside_the_tables(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_report(summarize(RECORDS), tmp_path, "run", {"model": "m", "command": "lukv ruler m"})
    picture = tmp_path / "run_1024.png"
    assert paths["run_1024"] == picture
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "global/kvzap@mem0.1" in paths["md"].read_text()


def _results(path, records, model="m", seed=42):
    lines = [{"kind": "run", "model": model, "seed": seed}, *records]
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "sample", "cut', encoding="utf-8"
    )


def test_report_writes_the_tables_from_the_file_alone_with_the_compared_runs(tmp_path, monkeypatch, capsys):
    import lukv_cache.evaluation.ruler.command as command

    monkeypatch.setattr(command, "load_model", lambda *a, **k: pytest.fail("--report loaded a model"))
    ours = [r for r in RECORDS if not r["method"].startswith("kvpress:")]
    _results(tmp_path / "run.jsonl", ours)
    _results(tmp_path / "kvpress.jsonl", [r for r in RECORDS if r["method"].startswith("kvpress:")])
    argv = ["ruler", "smollm2", "--report", "--out", str(tmp_path), "--name", "run"]
    assert main([*argv, "--compare", str(tmp_path / "kvpress.jsonl")]) == 0
    table = (tmp_path / "run.md").read_text()
    assert "| kvpress:snapkv@0.8 | 1.000 | 0.0 ± 0.0 |" in table  # the compared run joins ours
    assert "| global/kvzap@0.8 | 0.200 | 25.0 ±" in table
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert len(rows) == 6 and rows[0]["method"] == "full"
    assert "kvpress:snapkv@0.8" in capsys.readouterr().out
    assert main([*argv, "--samples", "1"]) == 0  # the first sample of each task only
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert {task["n"] for row in rows for task in row["tasks"].values()} == {1}
    assert rows[1]["method"] == "global/kvzap@0.5" and rows[2]["average"] == 0.0  # kvzap@0.8 scored 0 on #0
    # --report-name: a comparison written beside the results' own report, which stays as it was
    own = (tmp_path / "run.md").read_text()
    assert main([*argv, "--compare", str(tmp_path / "kvpress.jsonl"), "--report-name", "run_vs"]) == 0
    assert (tmp_path / "run.md").read_text() == own
    assert "| kvpress:snapkv@0.8 |" in (tmp_path / "run_vs.md").read_text()


def test_report_refuses_a_compared_run_of_another_model_or_no_results(tmp_path, capsys):
    _results(tmp_path / "run.jsonl", RECORDS[:4])
    _results(tmp_path / "other.jsonl", RECORDS[-4:], model="another/model")
    argv = ["ruler", "smollm2", "--report", "--out", str(tmp_path)]
    assert main([*argv, "--name", "run", "--compare", str(tmp_path / "other.jsonl")]) == 2
    assert "holds a run of 'another/model'" in capsys.readouterr().err
    assert main([*argv, "--name", "missing"]) == 2
    assert "No results file" in capsys.readouterr().err
    assert not (tmp_path / "run.md").exists()
