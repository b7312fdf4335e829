"""Which features should the KVzap surrogate read? Fidelity of ridge surrogates on held-out text.

For every full-attention layer and KV head of SmolLM2-135M-Instruct, ridge regressions of log KVzip+
(the library's ``kvzip_plus``) on four feature sets, trained on news documents and scored on Wikipedia
documents (Spearman correlation per head and document, averaged per layer):

* ``hidden``: the hidden state entering the attention layer (what kvpress' KVzap reads; needs a hook);
* ``query``: the pre-RoPE queries of all heads (``W_q h``; the same information as ``hidden`` when
  ``W_q`` is invertible);
* ``kv_all``: the pre-RoPE keys and values of every KV head of the layer;
* ``kv_head``: the head's own pre-RoPE key and value (the library's choice: read from the cache, and a
  tensor-parallel rank holds its heads' features).

    python benchmarks/kvzap_features.py --train 24 --test 8 --threads 1 --out benchmarks/results/kvzap_features.md

``--smoke``: 2 training and 1 test documents of 128 tokens on the stand-ins of ``benchmarks/_smoke.py``,
written in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import _smoke
import torch
from _out import default_out, write_table

from lukv_cache.models import load_smollm2
from lukv_cache.profiling.kvzap import (
    SKIP_FIRST,
    kvzip_targets,
    news_documents,
    spearman,
    token_feature_maps,
)
from lukv_cache.profiling.ridge import RidgeStats

SETS = ("hidden", "query", "kv_all", "kv_head")


def wikipedia_documents(tokenizer, count: int, tokens: int) -> list[torch.Tensor]:
    from lukv_cache.texts import wikipedia_articles

    docs = []
    for article in wikipedia_articles(min_chars=tokens * 6):
        ids = tokenizer(article.text, add_special_tokens=False)["input_ids"][:tokens]
        docs.append(torch.tensor([ids]))
        if len(docs) == count:
            return docs
    raise SystemExit("not enough Wikipedia articles")


def feature_sets(model, ids) -> tuple[dict[str, dict[int, torch.Tensor]], dict[int, torch.Tensor]]:
    """Per set: {layer: [H, T, F]} (the same features for every head except kv_head); and targets [T, H]."""
    hidden: dict[int, torch.Tensor] = {}
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn

        def grab(module, args, kwargs, attn=attn):
            hidden[attn.layer_idx] = kwargs["hidden_states"][0].detach().float()

        hooks.append(attn.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        kv = token_feature_maps(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    heads = model.config.num_key_value_heads
    sets: dict[str, dict[int, torch.Tensor]] = {name: {} for name in SETS}
    for layer, h in hidden.items():
        attn = model.model.layers[layer].self_attn
        with torch.no_grad():
            query = attn.q_proj(h)
        kv_all = kv[layer][0]  # [T, H * 2D]: every head's pre-RoPE key and value
        both = kv_all.view(kv_all.shape[0], heads, -1).transpose(0, 1)  # [H, T, 2D]
        for name, x in (("hidden", h), ("query", query), ("kv_all", kv_all)):
            sets[name][layer] = x.unsqueeze(0).expand(heads, -1, -1)
        sets["kv_head"][layer] = both
    targets = {layer: t[0] for layer, t in kvzip_targets(model, tokenizer_, ids).items()}
    return sets, targets


def main() -> None:
    global tokenizer_
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=24)
    parser.add_argument("--test", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=default_out("kvzap_surrogate") / "kvzap_features.md")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin().out("kvzap_features.md")
        args.train, args.test, args.tokens, args.threads = 2, 1, 128, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.time()
    model, tokenizer_ = load_smollm2()
    train = news_documents(tokenizer_, args.train, args.tokens, seed=0)
    test = wikipedia_documents(tokenizer_, args.test, args.tokens)
    stats: dict[tuple[str, int, int], RidgeStats] = {}
    for i, ids in enumerate(train):
        sets, targets = feature_sets(model, ids)
        for name, layers in sets.items():
            for layer, x in layers.items():
                if layer not in targets:
                    continue
                for h in range(x.shape[0]):
                    key = (name, layer, h)
                    stats.setdefault(key, RidgeStats(x.shape[-1], 1))
                    stats[key].add(x[h, SKIP_FIRST:], targets[layer][SKIP_FIRST:, h : h + 1])
        print(f"train {i + 1}/{len(train)} ({time.time() - started:.0f} s)", flush=True)
    solved = {key: s.solve(args.alpha) for key, s in stats.items()}
    rhos: dict[tuple[str, int], list[float]] = {}
    for i, ids in enumerate(test):
        sets, targets = feature_sets(model, ids)
        for (name, layer, h), (weight, bias, mean, std) in solved.items():
            x = (sets[name][layer][h, SKIP_FIRST:] - mean) / std
            predicted = x @ weight[:, 0] + bias[0]
            rhos.setdefault((name, layer), []).append(spearman(predicted, targets[layer][SKIP_FIRST:, h]))
        print(f"test {i + 1}/{len(test)} ({time.time() - started:.0f} s)", flush=True)
    layers = sorted({layer for _, layer in rhos})
    per_layer = {name: [statistics.mean(rhos[name, layer]) for layer in layers] for name in SETS}
    lines = [
        "# KVzap surrogate features: fidelity on held-out text (SmolLM2-135M-Instruct)",
        "",
        f"Command: `python benchmarks/kvzap_features.py --train {args.train} --test {args.test} --tokens "
        f"{args.tokens} --alpha {args.alpha} --threads {args.threads}`; {time.time() - started:.0f} s.",
        "",
        f"Ridge (alpha {args.alpha}, standardised inputs) per (layer, KV head) on log KVzip+ (`kvzip_plus`), "
        f"trained on {args.train} news documents of {args.tokens} tokens (gensim's lee_background), "
        f"scored on {args.test} Wikipedia documents of {args.tokens} tokens (gensim's dump): Spearman "
        "correlation per (head, document), averaged per layer; tokens after the 4 sinks.",
        "",
        "| features | dims per head | median over layers | min | max | mean |",
        "|---|---|---|---|---|---|",
    ]
    dims = {name: solved[name, layers[0], 0][0].shape[0] for name in SETS}
    for name in SETS:
        v = per_layer[name]
        lines.append(
            f"| {name} | {dims[name]} | {statistics.median(v):.3f} | {min(v):.3f} | {max(v):.3f} | "
            f"{statistics.mean(v):.3f} |"
        )
    lines += ["", "Per layer:", "", "| layer | " + " | ".join(SETS) + " |", "|---" * (len(SETS) + 1) + "|"]
    for i, layer in enumerate(layers):
        lines.append(f"| {layer} | " + " | ".join(f"{per_layer[name][i]:.3f}" for name in SETS) + " |")
    write_table(args.out, lines)


tokenizer_ = None

if __name__ == "__main__":
    main()
