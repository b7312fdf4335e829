"""Saved compressed contexts: file size against the cache's memory, and save / load time against compressing
the context again with KVzip, on the real SmolLM2-135M-Instruct and a ~4k-token Wikipedia context.

KVzip (ratio 0.8, one global budget) compresses the context once (``cache.prefill``: the context's forward,
the repeat passes, eviction); ``save_cache`` writes it, ``load_cache`` reads it back (each timed over
``--repeats`` runs, the median reported), and a question is answered greedily from both caches (forks) to
check that the loaded one answers the same, token for token, with the largest logit difference printed;
once per store precision (``--kv-bits``: the model's, 8 and 4 bits).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/saved_contexts.py --threads 1 \\
        > benchmarks/results/saved_contexts/smollm2_4k.txt

``--smoke``: 128 tokens, once, 2 answer tokens, every precision, on the stand-ins of ``benchmarks/_smoke.py``
(``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _smoke
import torch
from _calls import cache_kw

from lukv_cache import LUKVCache, load_cache, save_cache
from lukv_cache.models import load_model
from lukv_cache.texts import wikipedia_articles

QUESTION = "\n\nQuestion: What is this article about, in one sentence?\nAnswer:"


def context_ids(tokenizer, tokens: int) -> tuple[str, torch.Tensor]:
    """The first Wikipedia article long enough, cut to ``tokens`` tokens."""
    article = next(a for a in wikipedia_articles(min_chars=6 * tokens))
    ids = tokenizer(article.text, return_tensors="pt").input_ids[:, :tokens]
    return article.title, ids


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def answer(model, prompt: torch.Tensor, cache, new_tokens: int):
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            **{cache_kw(model): cache},
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    parser.add_argument("--ratio", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=5, help="runs of save and of load (median)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--kv-bits",
        nargs="+",
        default=["none", "8", "4"],
        help="store precisions to measure (none: the model's)",
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        _smoke.begin()
        args.threads, args.tokens, args.repeats, args.new_tokens = 1, 128, 1, 2
        args.kv_bits = ["none", "8", "4"]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2")
    title, ids = context_ids(tokenizer, args.tokens)
    text = model.config.get_text_config()
    print(f"command: {' '.join(['python', *sys.argv])}")
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {platform.processor() or platform.machine()}"
    )
    print(
        f"model: {model.config.name_or_path} ({text.num_hidden_layers} layers, {text.num_key_value_heads} KV heads)"
    )
    print(f"context: Wikipedia '{title}', {ids.shape[1]} tokens; KVzip ratio {args.ratio}, allocator global")

    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dense = (
        2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * ids.shape[1] * model.dtype.itemsize
    )
    print(f"uncompressed KV: {dense / 2**20:.2f} MiB")
    question = tokenizer(QUESTION, return_tensors="pt", add_special_tokens=False).input_ids
    prompt = torch.cat([ids, question], dim=1)
    for bits in args.kv_bits:
        measure(model, tokenizer, ids, prompt, None if bits == "none" else int(bits), args)


def measure(model, tokenizer, ids: torch.Tensor, prompt: torch.Tensor, kv_bits: int | None, args) -> None:
    """Compress ``ids`` with KVzip at ``kv_bits``, save, load, and answer from both caches."""

    def compress():
        cache = LUKVCache(ratio=args.ratio, scorer="kvzip", allocator="global", kv_bits=kv_bits)
        cache.prefill(model, ids, tokenizer=tokenizer)
        return cache

    compress_s, cache = timed(compress, 1)
    kept = cache.stored_tokens().float().mean().item()
    memory = cache.memory_bytes()
    print(f"\nkv_bits={kv_bits}")
    print(f"  KVzip compression (prefill + repeat passes + eviction): {compress_s:.2f} s")
    print(f"  kept per (layer, KV head): {kept:.0f} of {ids.shape[1]} tokens on average")
    print(f"  cache.memory_bytes(): {memory / 2**20:.2f} MiB")
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "context.safetensors"
        save_s, _ = timed(lambda: save_cache(cache, path), args.repeats)
        size = path.stat().st_size
        load_s, loaded = timed(lambda: load_cache(path, model), args.repeats)
    print(f"  file: {size / 2**20:.2f} MiB = {size / memory:.3f} x cache.memory_bytes()")
    print(
        f"  save_cache: {save_s * 1e3:.1f} ms, load_cache: {load_s * 1e3:.1f} ms (medians of {args.repeats})"
    )
    print(f"  KVzip compression / load: {compress_s / load_s:.0f}x")
    want, want_logits = answer(model, prompt, cache.fork(), args.new_tokens)
    got, got_logits = answer(model, prompt, loaded.fork(), args.new_tokens)
    print(
        f"  answer from the loaded cache equals the saved cache's: {torch.equal(got, want)} "
        f"({args.new_tokens} greedy tokens, largest logit difference "
        f"{(got_logits - want_logits).abs().max().item():.3g})"
    )
    print(f"  answer: {tokenizer.decode(got[0, prompt.shape[1] :], skip_special_tokens=True).strip()!r}")


if __name__ == "__main__":
    main()
