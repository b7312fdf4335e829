"""One process of the tensor-parallel test (``tests/cache/test_tensor_parallel.py``), and its cases.

``python -m torch.distributed.run --nproc-per-node 2 _tp_worker.py MODEL_DIR PROFILE OUT_DIR`` loads the
tiny Llama saved in ``MODEL_DIR`` with ``tp_plan="auto"`` (gloo on CPU), runs :func:`run_cases` and writes
``OUT_DIR/rank<r>.json``. The test runs the same cases in its own process on the unsharded model and
compares tokens and per-(layer, KV head) budgets.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

# tests/ (helpers.py), whether imported by the test or run by torch.distributed.run from its own folder
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_LEN = 60
PAD = 0
NEW_TOKENS = 6


def make_model(model_dir: str):
    """The tiny Llama of the test (8 query / 4 KV heads, 2 layers), random weights from seed 0."""
    from lukv_cache.testing import tiny_model

    model = tiny_model(
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=PAD
    )
    model.save_pretrained(model_dir)


def make_profile(path: str):
    """A profile whose every (layer, KV head) has its own evict ratio: a rank reading another block of
    heads, or renormalising over its own, gets other budgets."""
    import numpy as np

    from lukv_cache.testing import array_profile

    grid = np.array([0.5, 0.8, 0.9], dtype=np.float32)
    spread = np.linspace(-0.15, 0.08, 8, dtype=np.float32).reshape(2, 4)
    ratios = np.stack([np.clip(r + spread, 0.0, 1.0) for r in grid])
    array_profile(grid, ratios, model_id="org/tiny-tp", head_dim=16).save(path)


def inputs():
    """Two left-padded rows (the second has 9 padding tokens)."""
    ids = torch.randint(3, 128, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = PAD, 0
    return ids, mask


def run_cases(model, profile_path: str) -> dict:
    """Every case: ``{"tokens": [B, NEW_TOKENS], "stored": [L, B, local KV heads], "heads": [start, stop]}``."""
    from helpers import scorer_for
    from transformers import DynamicCache

    from lukv_cache import LUKVCache
    from lukv_cache.scorers.kvzip import RepeatPrompt

    ids, mask = inputs()
    mesh = getattr(model, "_device_mesh", None)
    caches = {
        "dynamic": lambda: DynamicCache(),
        "uniform_0": lambda: LUKVCache(0.0, "keydiff", "uniform"),
        "profile_0": lambda: LUKVCache.from_pretrained(profile_path, ratio=0.0),
        "profile_0.8": lambda: LUKVCache.from_pretrained(profile_path, ratio=0.8),
        "profile_0.8_config": lambda: LUKVCache.from_pretrained(profile_path, ratio=0.8, config=model.config),
        "profile_0.8_mesh": lambda: LUKVCache.from_pretrained(profile_path, ratio=0.8, device_mesh=mesh),
        "profile_max_tokens": lambda: LUKVCache.from_pretrained(profile_path, max_tokens=20),
        "hybrid_0.8": lambda: LUKVCache.from_pretrained(profile_path, ratio=0.8, allocator="hybrid"),
        "hybrid_global_0.8": lambda: LUKVCache.from_pretrained(
            profile_path, ratio=0.8, allocator="hybrid_global"
        ),
        "uniform_0.8": lambda: LUKVCache(0.8, "keydiff", "uniform"),
        "pyramid_0.8": lambda: LUKVCache(0.8, "keydiff", "pyramid"),
        "adakv_0.8": lambda: LUKVCache(0.8, "snapkv", "adakv"),
        "global_0.8": lambda: LUKVCache(0.8, "keydiff", "global"),
        "kvzip_plus_global_0.8": lambda: LUKVCache(0.8, "kvzip_plus", "global"),
        "kvzap_global_0.8": lambda: LUKVCache(0.8, scorer_for("kvzap", model), "global"),
        "kvzap_adakv_0.5": lambda: LUKVCache(0.5, scorer_for("kvzap", model), "adakv"),
        # eviction at fold time: the prompt capped at N, one fold 4 tokens later
        "decode_profile": lambda: LUKVCache.from_pretrained(
            profile_path, decode_max_tokens=20, fold_interval=4
        ),
        "decode_snapkv_adakv": lambda: LUKVCache(
            scorer="snapkv", allocator="adakv", decode_max_tokens=24, fold_interval=4, window=2
        ),
        "decode_kvzap_global": lambda: LUKVCache(
            scorer=scorer_for("kvzap", model), allocator="global", decode_max_tokens=40, fold_interval=4
        ),
        # the quantized store: each rank quantizes its own heads' kept tokens
        "uniform_0.8_int4": lambda: LUKVCache(0.8, "keydiff", "uniform", kv_bits=4),
        "decode_kvzap_global_int8": lambda: LUKVCache(
            scorer=scorer_for("kvzap", model),
            allocator="global",
            decode_max_tokens=40,
            fold_interval=4,
            kv_bits=8,
        ),
    }
    results = {}
    for name, make in caches.items():
        cache = make()
        if name.startswith("kvzip"):
            cache.prefill(model, ids, mask, repeat_prompt=RepeatPrompt((5, 6), (7,), (8,)))
        if name == "profile_0.8_mesh":  # a compressed context is copied and reused, as in one process
            cache.prefill(model, ids, mask)
            cache = copy.deepcopy(cache)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        shard = getattr(cache, "head_shard", None)
        heads = shard.heads(4) if shard is not None else slice(0, 4)
        stored = cache.stored_tokens() if isinstance(cache, LUKVCache) else torch.zeros(0)
        results[name] = {
            "tokens": out[:, -NEW_TOKENS:].tolist(),
            "stored": stored.tolist(),
            "heads": [heads.start, heads.stop],
        }
    return results


def main(model_dir: str, profile_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lukv_cache import LUKVCache, TensorParallelError

    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", attn_implementation="sdpa").eval()
    rank = dist.get_rank()
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    report = {
        "rank": rank,
        "tp_size": model.tp_size,
        "k_proj_local_rows": list(k_proj.to_local().shape),
        "results": run_cases(model, profile_path),
    }
    # a mesh without a "tp" dimension is refused with the typed error
    odd = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("a", "b"))
    try:
        LUKVCache(0.5, device_mesh=odd)
        report["mesh_error"] = None
    except TensorParallelError as err:
        report["mesh_error"] = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
