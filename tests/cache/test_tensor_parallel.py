"""Tensor parallelism: each rank's cache keeps its own block of KV heads with single-process budgets.

The end-to-end test runs transformers' own tensor parallelism (``from_pretrained(..., tp_plan="auto")``,
gloo on CPU, two processes on 127.0.0.1) and compares every rank's tokens and per-(layer, KV head) stored
counts with the same cases run here on the unsharded model. The unit tests check the head arithmetic
and the typed errors without processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tp_worker import make_model, make_profile, run_cases

from lukv_cache import ConfigurationError, LUKVCache, TensorParallelError
from lukv_cache.cache.layers.parallel import HeadShard, head_shard

WORKER = Path(__file__).with_name("_tp_worker.py")


# ---------------------------------------------------------------------------------------------- unit


@pytest.mark.parametrize(
    ("rank", "size", "heads", "expected"),
    [(0, 2, 4, (0, 2)), (1, 2, 4, (2, 4)), (3, 4, 8, (6, 8)), (0, 1, 3, (0, 3)), (2, 8, 8, (2, 3))],
)
def test_head_shard_is_the_ranks_contiguous_block(rank, size, heads, expected):
    shard = HeadShard.check(heads // size, heads, rank, size)
    assert (shard.heads(heads).start, shard.heads(heads).stop) == expected


def test_heads_not_divisible_by_the_tp_size_raise_a_typed_error():
    with pytest.raises(TensorParallelError, match="do not split evenly") as info:
        HeadShard.check(1, 6, rank=0, size=4)
    assert isinstance(info.value, ConfigurationError)
    assert (info.value.kv_heads, info.value.local_heads, info.value.tp_size) == (6, 1, 4)


def test_a_rank_holding_another_share_raises_a_typed_error():
    with pytest.raises(TensorParallelError, match="give 2 per rank"):
        HeadShard.check(1, 4, rank=0, size=2)
    with pytest.raises(TensorParallelError, match="not a valid rank"):
        HeadShard.check(2, 4, rank=2, size=2)


def test_device_mesh_must_be_a_device_mesh():
    with pytest.raises(TensorParallelError, match="DeviceMesh"):
        LUKVCache(0.5, device_mesh=2)


def test_a_single_process_that_sees_every_head_has_no_shard():
    assert head_shard(4, 4) is None
    assert head_shard(2, None) is None
    # fewer heads than the config says, no mesh, no process group: left alone (not tensor-parallel)
    assert head_shard(2, 4) is None


def test_a_shard_without_a_group_cannot_gather():
    with pytest.raises(TensorParallelError, match="process group"):
        HeadShard(0, 2).gather(torch.zeros(1, 1, 2, 3), dim=2)
    local = torch.ones(1, 1, 2, 3)
    assert HeadShard(0, 1).gather(local, dim=2) is local


# ---------------------------------------------------------------------------------------------- torchrun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_ranks_match_a_single_process_run(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir, profile, out = tmp_path / "model", str(tmp_path / "keydiff.safetensors"), tmp_path / "out"
    out.mkdir()
    make_model(str(model_dir))
    make_profile(profile)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(WORKER),
            str(model_dir),
            profile,
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, (
        f"torchrun failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa").eval()
    reference = run_cases(model, profile)

    for report in ranks:
        assert report["tp_size"] == 2
        assert report["k_proj_local_rows"] == [2 * 16, 64]  # transformers really sharded the KV heads
        assert "'tp'" in report["mesh_error"]
    single_tokens = reference["dynamic"]["tokens"]
    for name, expected in reference.items():
        for r, report in enumerate(ranks):
            got = report["results"][name]
            if name == "dynamic":
                assert got["tokens"] == single_tokens, "transformers' TP alone changed the tokens"
                continue
            assert got["heads"] == [2 * r, 2 * r + 2], name
            assert got["tokens"] == expected["tokens"], f"{name}, rank {r}: tokens differ"
        stored = torch.cat([torch.tensor(report["results"][name]["stored"]) for report in ranks], dim=2)
        if name != "dynamic":
            assert stored.tolist() == expected["stored"], f"{name}: per-(layer, head) budgets differ"
    # the cases really evict, and with unequal budgets per head (a wrong slice would show)
    profile_stored = torch.tensor(reference["profile_0.8"]["stored"])
    assert profile_stored.unique().numel() > 4 and profile_stored.max() < 60
    for name, n in (("decode_profile", 20), ("decode_snapkv_adakv", 24), ("decode_kvzap_global", 40)):
        per_row = torch.tensor(reference[name]["stored"]).double().mean((0, 2))
        assert (per_row == n + 1).all(), (name, per_row)  # N per row after the fold, and one more token
    assert reference["uniform_0"]["tokens"] == single_tokens
    assert reference["profile_0"]["tokens"] == single_tokens
