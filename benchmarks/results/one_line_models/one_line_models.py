"""The README's one line on the three packaged real models, offline: with the shipped profile, and with a
scorer that has no profile for the model (the profile-free fallback). Prints what each cache chose, the
bytes it holds against a DynamicCache, and the answer to a fact planted in ~800 tokens of Wikipedia."""

import logging
import os
import sys
import time
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from lukv_cache import LUKVCache  # noqa: E402
from lukv_cache._compat import cache_kwarg  # noqa: E402
from lukv_cache.models import load_model  # noqa: E402
from lukv_cache.texts import wikipedia_articles  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
THREADS = int(os.environ.get("THREADS", "1"))
torch.set_num_threads(THREADS)
FACT = " The secret code of the lighthouse keeper is 4817-2093."


def kv_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "memory_bytes"):
            total += layer.memory_bytes()
        else:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def caches(model):
    model_id = model.config.name_or_path
    yield "DynamicCache", DynamicCache(config=model.config)
    yield "one line", LUKVCache.from_pretrained(model_id, ratio=0.8)
    yield "one line, scorer=snapkv", LUKVCache.from_pretrained(model_id, ratio=0.8, scorer="snapkv")


for alias in sys.argv[1:]:
    model, tok = load_model(alias, threads=THREADS)
    words = wikipedia_articles()[3].text.split()
    body = " ".join(words[:300]) + FACT + " " + " ".join(words[300:600])
    prompt = body + "\n\nQuestion: What is the secret code of the lighthouse keeper?\nAnswer:"
    ids = tok(prompt, return_tensors="pt").input_ids
    key = cache_kwarg(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = caches(model)
        while True:
            seen = len(caught)
            try:
                label, cache = next(made)
            except StopIteration:
                break
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, **{key: cache}, max_new_tokens=10, do_sample=False)
            dt = time.perf_counter() - t0
            lukv = [
                str(w.message)[:160]
                for w in caught[seen:]
                if "lukv" in (w.filename or "") or "LUKVCache" in str(w.message)
            ]
            answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            prof = getattr(cache, "profile", "n/a")
            shown = "none" if prof is None else getattr(prof, "scorer", prof)
            method = repr(cache)[:110] if isinstance(cache, LUKVCache) else "DynamicCache"
            print(
                f"{alias} | {ids.shape[1]} tokens | {label} | profile={shown} | {method} | "
                f"KV {kv_bytes(cache) / 2**20:.2f} MiB | {dt:.1f} s | answer {answer!r} | lukv warnings: {lukv}",
                flush=True,
            )
