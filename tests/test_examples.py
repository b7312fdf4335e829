"""Every script in examples/ runs in its ``--smoke`` mode: a tiny random model, synthetic text, no network.

The scripts run in this process (``runpy``, as ``python examples/x.py --smoke`` would run them), except the
tensor-parallel one, which ``torchrun`` starts as two processes (gloo on CPU, 127.0.0.1).
"""

from __future__ import annotations

import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def run_example(monkeypatch, capsys):
    """``run_example("quickstart.py", *args)`` runs the script with ``--smoke`` and returns its stdout."""
    import huggingface_hub.constants

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the smoke runs never reach for the Hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("LUKV_PROFILE_DIR", raising=False)  # the tiny profile's mirror is set, then undone

    def run(name: str, *args: str) -> str:
        monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), "--smoke", *args])
        try:
            runpy.run_path(str(EXAMPLES / name), run_name="__main__")
        except SystemExit as exit_:
            assert exit_.code in (0, None), f"{name} exited with {exit_.code}"
        return capsys.readouterr().out

    return run


def test_every_example_is_tested_here():
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    source = Path(__file__).read_text()
    assert scripts == {s for s in scripts if f'"{s}"' in source}, "an example without a smoke test"


def test_quickstart(run_example):
    out = run_example("quickstart.py")
    assert "tiny-llama/keydiff.safetensors" in out  # the profile was found (in the smoke run's mirror)
    kept, prompt = map(int, re.search(r"kept per head: (\d+) of (\d+)", out).groups())
    assert kept < 0.3 * prompt  # ratio 0.8 keeps about 20%


def test_long_context_asks_one_compressed_context_many_questions(run_example):
    out = run_example("long_context.py")
    assert out.count("Q: ") == out.count("A: ") == 3
    context, kept = map(int, re.search(r"context: (\d+) tokens, (\d+) kept", out).groups())
    assert kept < 0.3 * context


def test_token_budget_bounds_every_prompt(run_example):
    out = run_example("token_budget.py", "--max-tokens", "64")
    rows = [
        list(map(int, line.split())) for line in out.splitlines() if re.fullmatch(r"\s*\d+\s+\d+\s+\d+", line)
    ]
    assert [prompt for prompt, _, _ in rows] == [32, 128, 384]
    assert all(budget == min(prompt, 64) for prompt, budget, _ in rows)
    assert rows[-1][2] > 64  # ratio=0.8 grows with the prompt


def test_own_profile_is_built_published_and_loaded(run_example):
    out = run_example("own_profile.py")
    assert "built keydiff profile for lukv-examples/tiny-llama: 2 layers x 2 KV heads" in out
    assert "[('lukv-examples/tiny-llama', 'keydiff')]" in out and "generated 8 tokens" in out


def test_check_ratio(run_example):
    out = run_example("check_ratio.py", "--ratios", "0.5", "0.9")
    for allocator in ("uniform", "global"):
        assert re.search(rf"^{allocator}\s+0\.9\b", out, re.MULTILINE), out


def test_tensor_parallel_under_torchrun(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("LUKV_PROFILE_DIR", None)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), str(EXAMPLES / "tensor_parallel.py"), "--smoke"],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "rank 0 of 2: KV heads 0..0" in run.stdout and "rank 1 of 2: KV heads 1..1" in run.stdout
