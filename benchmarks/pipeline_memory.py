"""Memory of one context, 8 questions: LUKVCache.fork (what LUKVPipeline uses) against a copy.deepcopy per
question, on the real SmolLM2-135M-Instruct with its shipped profile at ratio 0.8 (the README's one line).

Counts the bytes of every distinct tensor storage the caches hold (a shared store counts once), with all 8
question caches kept alive (as a server answering them together would) and per question.

    python benchmarks/pipeline_memory.py --threads 2 > benchmarks/results/pipeline_memory/smollm2.txt

``--smoke``: 2 new tokens per question, on the stand-ins of ``benchmarks/_smoke.py`` (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import copy

import _smoke
import torch
from _calls import cache_kw

from lukv_cache import LUKVCache
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.models import load_model
from lukv_cache.texts import wikipedia_articles

QUESTIONS = [f"\n\nQuestion: what is said about point {i}?\nAnswer:" for i in range(8)]


def tensors(cache):
    for layer in cache.layers:
        if isinstance(layer, LUKVLayer):
            store = layer.store
            if store is not None:
                yield from (
                    t
                    for t in (store.keys, store.values, store.positions, store.offsets, store.scores)
                    if t is not None
                )
            yield from layer.suffix_buffers or ()
            record = layer.eviction
            yield from (t for t in (record.sinks_left, record.queries) if t is not None)
        else:
            yield from (
                t
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(t, torch.Tensor)
            )


def distinct_bytes(caches) -> int:
    seen, total = set(), 0
    for cache in caches:
        for t in tensors(cache):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        _smoke.begin()
        args.threads, args.new_tokens = 1, 2
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2")
    context = wikipedia_articles()[0].text[:6000]
    ids = tokenizer(context, return_tensors="pt").input_ids
    cache = LUKVCache.from_pretrained(model.config.name_or_path, ratio=0.8)
    with torch.no_grad():
        cache.prefill(model, ids, tokenizer=tokenizer)
    context_bytes = distinct_bytes([cache])
    rows = {}
    for name, make in (("fork", lambda: cache.fork()), ("deepcopy", lambda: copy.deepcopy(cache))):
        copies, answers = [], []
        for question in QUESTIONS:
            q = tokenizer(question, add_special_tokens=False, return_tensors="pt").input_ids
            full = torch.cat([ids, q], 1)
            mine = make()
            with torch.no_grad():
                out = model.generate(
                    full,
                    attention_mask=torch.ones_like(full),
                    **{cache_kw(model): mine},
                    max_new_tokens=args.new_tokens,
                    do_sample=False,
                )
            copies.append(mine)
            answers.append(out[0, full.shape[1] :].tolist())
        rows[name] = (distinct_bytes([cache, *copies]), answers)
    same = rows["fork"][1] == rows["deepcopy"][1]
    print(
        f"context: {ids.shape[1]} tokens, compressed cache {context_bytes / 2**20:.2f} MiB "
        f"(scorer {cache.scorer.name}, allocator {cache.allocator_name}, ratio 0.8)"
    )
    for name, (total, _) in rows.items():
        extra = (total - context_bytes) / len(QUESTIONS)
        print(
            f"{name:9s} context + 8 question caches alive: {total / 2**20:7.2f} MiB; per question beyond the "
            f"context: {extra / 2**20:6.3f} MiB"
        )
    print(f"answers identical (greedy, {args.new_tokens} tokens each): {same}")


if __name__ == "__main__":
    main()
