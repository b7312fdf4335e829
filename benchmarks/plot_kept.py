"""Makes docs/images/kept_smollm2.png: what LUKVCache keeps of a Wikipedia paragraph in SmolLM2-135M.

    OMP_NUM_THREADS=2 python benchmarks/plot_kept.py --out docs/images/kept_smollm2.png [--ratio 0.8]
                                                      [--threads 2]

(without ``--out`` the image goes to ``<lukv cache>/bench/plot_kept/``, outside the repository).

The packaged SmolLM2-135M-Instruct, its shipped profile (no network), the first paragraph of the first
gensim Wikipedia article of at least 600 characters, cut to 160 tokens; prints the text with its most-kept
tokens in [brackets] (as many as the cache holds on average: lukv_cache.plot.highlighted) and how many.

``--smoke``: on the stand-ins of ``benchmarks/_smoke.py``, the image written in a temporary folder
(``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _smoke
import matplotlib
from _calls import cache_kw
from _out import default_out

matplotlib.use("Agg")

import torch  # noqa: E402

from lukv_cache import LUKVCache  # noqa: E402
from lukv_cache.models import load_model  # noqa: E402
from lukv_cache.plot import highlighted, kept_map, plot_kept  # noqa: E402
from lukv_cache.texts import wikipedia_articles  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(default_out("plot_kept") / "kept_smollm2.png"))
    parser.add_argument("--ratio", type=float, default=0.8)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out, args.threads = str(_smoke.begin().out("kept.png")), 1
    model, tokenizer = load_model("smollm2", threads=args.threads)
    article = wikipedia_articles(min_chars=600)[0]
    paragraph = next(p for p in article.text.split("\n") if len(p) >= 600)
    ids = tokenizer(paragraph, return_tensors="pt").input_ids[:, : args.tokens]
    cache = LUKVCache.from_pretrained(model, ratio=args.ratio)
    with torch.no_grad():
        model(input_ids=ids, **{cache_kw(model): cache})
    fig, text = plot_kept(cache, input_ids=ids, tokenizer=tokenizer)
    fig.axes[0].set_title(
        f"SmolLM2-135M, {cache.scorer.name} at ratio {args.ratio}: {article.title}", fontsize=9
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(text)
    share = kept_map(cache, [i for i in range(len(cache.layers)) if cache.kept_positions(i).numel()]).mean(0)
    marked, tokens = int(highlighted(share).sum()), share.numel()
    print(f"\n{marked} of {tokens} tokens in [brackets] ({marked / tokens:.0%}); wrote {args.out}")


if __name__ == "__main__":
    main()
