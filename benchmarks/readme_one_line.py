"""The README's first block ("Compress a prompt and generate") as it stands, plus the figures quoted for it
(docs/benchmarks.md, SmolLM2-135M-Instruct; the README keeps the bytes): tokens kept per (layer, KV head)
against the prompt's length, and the cache's bytes against a full fp32 cache of the prompt.

    python benchmarks/readme_one_line.py > benchmarks/results/readme_one_line/readme_one_line.txt

``--smoke``: on the stand-ins of ``benchmarks/_smoke.py``, one thread (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse

import _smoke
import torch

from lukv_cache import LUKVCache
from lukv_cache.models import load_model
from lukv_cache.texts import wikipedia_articles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    if parser.parse_args().smoke:
        _smoke.begin()
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2")
    model_id = model.config.name_or_path
    text = wikipedia_articles()[0].text[:6000]
    input_ids = tokenizer(text, return_tensors="pt").input_ids

    cache = LUKVCache.from_pretrained(model_id, ratio=0.8)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)  # noqa: F841  (the README's line)

    config = model.config
    prompt = input_ids.shape[1]
    full = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * prompt
    kept = cache.stored_tokens().float().mean().item()
    print(
        f"scorer {cache.profile.scorer}, allocator {cache.allocator_name}, ratio 0.8, {prompt}-token prompt, 64 new tokens"
    )
    print(
        f"tokens per (layer, KV head): {kept:.0f} of {prompt} ({kept / prompt:.0%}), sinks, window and generated included"
    )
    print(
        f"bytes: {cache.memory_bytes() / 1e6:.1f} MB against {full / 1e6:.1f} MB for a full fp32 cache of the prompt "
        f"({cache.memory_bytes() / full:.1%})"
    )


if __name__ == "__main__":
    main()
