"""A long-running process does not grow: hundreds of requests through every option that builds stores
(``kv_bits``, folds while decoding, ``fork()``, the pipeline, saved contexts saved, loaded and dropped,
and the attention paths over them) leave as many live tensors, and the attention's per-store caches as
many entries, after ``3N`` requests as after ``N``.

Each store a cache builds (at every eviction and every fold) is read by attention, which derives data
from it once (block bounds, the equal-segments flag, masks, tile plans) in weak-keyed caches: those must
die with the store, or a server leaks a little at every request, without end (issue 42, item 1).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import replace

import torch
from helpers import CharTokenizer, tiny_model

from lukv_cache import LUKVCache, LUKVPipeline, load_cache, save_cache
from lukv_cache.attention import compressed, cpu_codes, limits, masked, tiles
from lukv_cache.testing import prompt

CONTEXT = 40
NEW_TOKENS = 6


def _generate(model, ids, cache, kept: list) -> None:
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
    kept.append(cache)


def _filled(model, ids, **options) -> LUKVCache:
    cache = LUKVCache(**options)
    with torch.no_grad():
        cache.prefill(model, ids)
    return cache


def _question(ids, seed):
    return torch.cat([ids, prompt(1, 4, seed=seed)], 1)


def _requests(model, bf16_model, tmp_path, seed: int, kept: list | None = None) -> int:
    """One round of requests with every option that builds stores; returns how many it made. ``kept``
    collects the caches (else they die at the end of the round)."""
    kept = [] if kept is None else kept
    ids = prompt(1, CONTEXT, seed=seed)
    # folds while decoding (a new store at every fold), quantized at 8 and 4 bits and not at all; adakv
    # gives the heads ragged budgets (the masked product with a mask)
    for kv_bits in (8, 4, None):
        _generate(
            model,
            ids,
            LUKVCache(0.5, allocator="adakv", kv_bits=kv_bits, decode_max_tokens=32, fold_interval=2),
            kept,
        )
    # forks of one quantized context, one question each
    context = _filled(model, ids, ratio=0.5, kv_bits=4)
    for q in range(2):
        _generate(model, _question(ids, seed + q), context.fork(), kept)
    # the pipeline: one context, two questions
    pipeline = LUKVPipeline(model, CharTokenizer(), ratio=0.5, kv_bits=8)
    pipeline("a context for the tiny model " * 2, ["who?", "when?"], max_new_tokens=3)
    kept.append(pipeline.cache)
    # a saved context: saved, loaded, answered from, dropped
    path = save_cache(_filled(model, ids, ratio=0.5, kv_bits=8), tmp_path / f"context-{seed}.safetensors")
    _generate(model, _question(ids, seed), load_cache(path, model), kept)
    path.unlink()
    # bf16: the tiles (the masked product is fp32 only)
    _generate(bf16_model, ids, LUKVCache(0.5, kv_bits=8, fold_interval=2), kept)
    # quantized stores of several blocks, each tiled (where the CPU kernel on the codes does not serve: off)
    with _limits(block_rows=16, masked_limit=0, masked_equal_limit=0), cpu_codes.turned_off():
        _generate(model, ids, LUKVCache(0.5, kv_bits=8, fold_interval=2), kept)
    # a memory budget: the bits chosen per prompt, the window folded into the store, folds under a bound
    _generate(model, ids, LUKVCache(memory=0.5, decode_max_tokens=48, fold_interval=2), kept)
    return 3 + 2 + 2 + 1 + 1 + 1 + 1


@contextlib.contextmanager
def _limits(**changes):
    """The attention limits changed for a while (for every layer of the model)."""
    saved = limits.LIMITS
    limits.LIMITS = replace(saved, **changes)
    try:
        yield
    finally:
        limits.LIMITS = saved


def _is_live_tensor(obj) -> bool:
    try:
        if not isinstance(obj, torch.Tensor):
            return False
        obj.untyped_storage()
    except (ReferenceError, RuntimeError):  # dead weak proxies; fake or functional tensors of other tests
        return False
    return True


def _census() -> dict[str, int]:
    """Live tensors and the sizes of attention's per-store caches, after a full collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = sum(1 for obj in gc.get_objects() if _is_live_tensor(obj))
    return {
        "tensors": tensors,
        "blocks": len(compressed._BLOCKS),
        "equal": len(masked._EQUAL),
        "masks": len(masked._MASKS),
        "tile plans": len(tiles._PLANS),
    }


def test_live_tensors_and_attention_caches_stop_growing_over_hundreds_of_requests(tmp_path):
    model, bf16_model = tiny_model("llama"), tiny_model("llama", dtype=torch.bfloat16)
    kept: list = []
    made = _requests(model, bf16_model, tmp_path, seed=0, kept=kept)  # also sets up what is set up once
    live = _census()
    assert all(live[name] for name in ("blocks", "equal", "masks", "tile plans")), live  # every path ran
    del kept
    rounds = 8
    for r in range(rounds):
        made += _requests(model, bf16_model, tmp_path, seed=1 + r)
    after_n = _census()
    for r in range(2 * rounds):
        made += _requests(model, bf16_model, tmp_path, seed=1 + rounds + r)
    after_3n = _census()
    assert after_3n == after_n, f"after {made} requests"
    assert made >= 250
