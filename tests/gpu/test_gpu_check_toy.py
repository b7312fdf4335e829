"""``benchmarks/gpu_check.py --toy --device cpu`` keeps running (CI guard for the device script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "toy.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_check.py"),
        "--toy",
        "--device",
        "cpu",
        "--contexts",
        "96",
        "160",
        "--decode-steps",
        "3",
        "--out",
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k != "LUKV_RAGGED_KERNEL"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_toy_run_exits_zero_and_writes_its_report(toy_run):
    proc, report = toy_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert report is not None and report["ok"] is True


def test_toy_run_checks_kernels_and_the_model(toy_run):
    _, report = toy_run
    assert report["kernel_check"] and all(r["ok"] for r in report["kernel_check"])
    assert report["model_check"]["ok"] and not report["model_check"]["nan"]


def test_toy_run_measures_three_caches_per_context_and_lukv_keeps_fewer_tokens(toy_run):
    _, report = toy_run
    for ctx in (96, 160):
        rows = {r["label"].split("(")[0]: r for r in report["runs"] if r["context"] == ctx}
        assert set(rows) == {"DynamicCache", "LUKVCache", "DynamicCache-uniform"}
        assert rows["LUKVCache"]["tokens_per_head_end"] < 0.5 * rows["DynamicCache"]["tokens_per_head_end"]
        assert rows["LUKVCache"]["cache_bytes"] < rows["DynamicCache"]["cache_bytes"]
        assert all(r["decode_ms_per_token"] > 0 and r["ttft_s"] > 0 for r in rows.values())


def test_toy_run_prints_the_table_last(toy_run):
    proc, _ = toy_run
    last = proc.stdout.strip().splitlines()
    assert any(line.lstrip().startswith("context") for line in last[-12:])
    assert "decode overhead" in last[-1]
