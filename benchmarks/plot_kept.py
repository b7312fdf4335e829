"""Makes docs/images/kept_smollm2.png: what LUKVCache keeps of a Wikipedia paragraph in SmolLM2-135M.

    OMP_NUM_THREADS=2 python benchmarks/plot_kept.py  [--out docs/images/kept_smollm2.png] [--ratio 0.8]

The packaged SmolLM2-135M-Instruct, its shipped profile (no network), the first paragraph of the first
gensim Wikipedia article of at least 600 characters, cut to 160 tokens; prints the highlighted text.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from lukv_cache import LUKVCache  # noqa: E402
from lukv_cache.models import load_model  # noqa: E402
from lukv_cache.plot import plot_kept  # noqa: E402
from lukv_cache.texts import wikipedia_articles  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs/images/kept_smollm2.png")
    parser.add_argument("--ratio", type=float, default=0.8)
    parser.add_argument("--tokens", type=int, default=160)
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2", threads=2)
    article = wikipedia_articles(min_chars=600)[0]
    paragraph = next(p for p in article.text.split("\n") if len(p) >= 600)
    ids = tokenizer(paragraph, return_tensors="pt").input_ids[:, : args.tokens]
    cache = LUKVCache.from_pretrained(model, ratio=args.ratio)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    fig, text = plot_kept(cache, input_ids=ids, tokenizer=tokenizer)
    fig.axes[0].set_title(
        f"SmolLM2-135M, {cache.scorer.name} at ratio {args.ratio}: {article.title}", fontsize=9
    )
    fig.savefig(args.out, dpi=80)
    print(text)


if __name__ == "__main__":
    main()
