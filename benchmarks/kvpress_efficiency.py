"""kvpress's head-wise presses (AdaKVPress, LUKVPress) measured like ``benchmarks/efficiency.py``.

kvpress 0.5.x pins ``transformers<5.3`` and breaks on the 5.23 this project needs, so this script runs in
its own virtual environment (torch reused from the system) and never imports ``lukv_cache``; the context
ids and the model folder come from the main interpreter (``--main-python``), so the text is the same as
``efficiency.py``'s.

    python -m venv --system-site-packages /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install kvpress==0.5.5 "transformers<5.3"
    /tmp/kvpress-venv/bin/python benchmarks/kvpress_efficiency.py --tokens 8192 --threads 1

kvpress's head-wise presses *mask* evicted keys (the cache keeps every token), so their KV bytes equal the
full cache's. LUKVPress needs a budget curve ``[99, L, H_kv]``; kvpress only ships Llama-3.1-8B's, so the
curve comes from a LU-KV profile (``--profile``, interpolated to 0.01 ... 0.99) or, without one, is flat
(every head evicts the global ratio: uniform budgets, the same mechanism and cost).

``--smoke`` (in the main interpreter, ``benchmarks/smoke.py``): what runs without kvpress, on the stand-ins
of ``benchmarks/_smoke.py``: the budget curves (flat, and from a profile file) and the no-press row
(prefill and decode timing of a DynamicCache); it says what it skipped: the presses and the context
fetched from the main interpreter (real SmolLM2 and Wikipedia).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

import _smoke
import numpy as np
import torch
from _out import default_out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

_CONTEXT = """
import json, sys
sys.path.insert(0, {root!r})
from transformers import AutoTokenizer
from lukv_cache.models import smollm2_path
from lukv_cache.texts import wikipedia_articles
path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)
ids = []
for article in sorted(wikipedia_articles(), key=lambda a: -len(a.text)):
    ids += tokenizer(article.text + "\\n\\n", add_special_tokens=False)["input_ids"]
    if len(ids) >= {tokens}:
        break
print(json.dumps({{"model_dir": str(path), "ids": ids[:{tokens}]}}))
"""


def context(main_python: str, tokens: int) -> tuple[str, list[int]]:
    """The converted SmolLM2 folder and the same real-text ids as efficiency.py, from the main interpreter."""
    out = subprocess.run(
        [main_python, "-c", _CONTEXT.format(root=ROOT, tokens=tokens)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    record = json.loads(out.strip().splitlines()[-1])
    return record["model_dir"], record["ids"]


def budget_curve(profile: str | None, layers: int, heads: int) -> np.ndarray:
    """``[99, L, H]`` local evict ratios at rho = 0.01 ... 0.99: from a profile file, or flat."""
    rhos = np.arange(1, 100, dtype=np.float32) / 100
    if profile is None:
        return np.broadcast_to(rhos[:, None, None], (99, layers, heads)).astype(np.float32).copy()
    from safetensors.numpy import load_file

    tensors = load_file(profile)
    grid, evict = tensors["grid"], tensors["evict_ratio"]
    flat = evict.reshape(len(grid), -1)
    curve = np.stack([np.interp(rhos, grid, flat[:, i]) for i in range(flat.shape[1])], axis=-1)
    return curve.reshape(99, layers, heads).astype(np.float32)


@torch.no_grad()
def decode_ms(model: Any, cache: Any, first_token: int, start: int, steps: int) -> float:
    """Median wall time of one greedy decoding step (after one warm-up step), explicit positions (efficiency.py
    times its rows with it too). The median, because the CPUs here are shared and a few steps stall."""
    token = torch.tensor([[first_token]])
    times = []
    for step in range(steps + 1):
        position = torch.tensor([[start + step]])
        started = time.perf_counter()
        logits = model(input_ids=token, past_key_values=cache, position_ids=position, use_cache=True).logits
        if step:
            times.append(time.perf_counter() - started)
        token = logits[:, -1:].argmax(-1)
    return 1000 * sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--profile", help="a LU-KV profile (.safetensors) for LUKVPress's budget curve")
    parser.add_argument("--main-python", default="python3", help="the interpreter that has lukv_cache's deps")
    parser.add_argument("--out", default=str(default_out("kvpress_efficiency")))
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.threads:
        torch.set_num_threads(args.threads)

    import kvpress
    import transformers
    from kvpress import AdaKVPress, KeyDiffPress, LUKVPress
    from kvpress.presses import lukv_press
    from transformers import DynamicCache, LlamaForCausalLM

    model_dir, ids = context(args.main_python, args.tokens)
    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model.config.name_or_path = MODEL_ID
    config = model.config
    curve_key = "local://lukv-profile" if args.profile else "local://flat"
    # kvpress fetches curves by URL through a cachetools cache keyed by the URL: seed it, no network.
    lukv_press.cache[curve_key] = budget_curve(
        args.profile, config.num_hidden_layers, config.num_key_value_heads
    )
    lukv_press.BUDGET_CURVE_URLS[(MODEL_ID, "KeyDiffPress")] = curve_key

    input_ids = torch.tensor([ids])
    t = input_ids.shape[1]
    methods: list[tuple[str, Any]] = [("no press (DynamicCache)", None)]
    for ratio in args.ratios:
        methods.append(
            (f"AdaKVPress(KeyDiffPress({ratio:g}))", AdaKVPress(KeyDiffPress(compression_ratio=ratio)))
        )
    for ratio in args.ratios:
        curve = "profile" if args.profile else "flat curve"
        methods.append((f"LUKVPress(KeyDiffPress, {ratio:g}, {curve})", LUKVPress(KeyDiffPress(), ratio)))

    rows = []
    print(
        f"kvpress {getattr(kvpress, '__version__', '0.5.x')}, transformers {transformers.__version__}, "
        f"{t} tokens, {torch.get_num_threads()} thread(s)"
    )
    print(f"{'method':<44} {'KV MB':>8} {'prefill s':>9} {'ms/token':>9}")
    for name, press in methods:
        cache = DynamicCache()
        with press(model) if press is not None else contextlib.nullcontext():
            started = time.perf_counter()
            with torch.no_grad():
                logits = model(
                    input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1
                ).logits
            prefill = time.perf_counter() - started
            held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
            ms = decode_ms(model, cache, int(logits[0, -1].argmax()), t, args.decode_steps)
        rows.append({"method": name, "kv_bytes": held, "prefill_s": prefill, "decode_ms_per_token": ms})
        print(f"{name:<44} {held / 1e6:8.1f} {prefill:9.1f} {ms:9.1f}", flush=True)
        del cache

    os.makedirs(args.out, exist_ok=True)
    command = " ".join(
        ["<kvpress venv>/bin/python benchmarks/kvpress_efficiency.py", *(argv or sys.argv[1:])]
    )
    record = {
        "command": command,
        "tokens": t,
        "kvpress": "0.5.5",
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    with open(os.path.join(args.out, f"kvpress_efficiency_{t}.json"), "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
    lines = [
        f"# kvpress at {t} tokens",
        "",
        f"Command: `{command}`",
        "",
        f"kvpress 0.5.5, transformers {transformers.__version__} (separate venv), "
        f"{torch.get_num_threads()} CPU thread(s), median of {args.decode_steps} decode steps, fp32. "
        "Head-wise presses mask evicted keys: the cache keeps every token.",
        "",
        "| method | KV MB | prefill s | decode ms/token |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['kv_bytes'] / 1e6:.1f} | {r['prefill_s']:.1f} | {r['decode_ms_per_token']:.1f} |"
        for r in rows
    ]
    with open(os.path.join(args.out, f"kvpress_efficiency_{t}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


def smoke() -> int:
    """``--smoke``: the parts that need no kvpress, on the stand-ins (see the module docstring)."""
    from transformers import DynamicCache, LlamaForCausalLM

    from lukv_cache.testing import prompt

    run = _smoke.begin()
    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(
        run.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for source in (None, str(run.profile("keydiff"))):
        curve = budget_curve(source, layers, heads)
        assert curve.shape == (99, layers, heads) and curve.dtype == np.float32, curve.shape
        print(f"budget curve from {source or 'nothing (flat)'}: {curve.shape}, at 0.5: {curve[49].ravel()}")
    input_ids = prompt(1, 256, vocab=256)
    t = input_ids.shape[1]
    print(f"{'method':<44} {'KV MB':>8} {'prefill s':>9} {'ms/token':>9}")
    cache = DynamicCache()
    started = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    prefill = time.perf_counter() - started
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    ms = decode_ms(model, cache, int(logits[0, -1].argmax()), t, 2)
    print(f"{'no press (DynamicCache)':<44} {held / 1e6:8.1f} {prefill:9.1f} {ms:9.1f}", flush=True)
    why = (
        "not installed" if importlib.util.find_spec("kvpress") is None else "run the script in kvpress's venv"
    )
    _smoke.skipped(f"kvpress's AdaKVPress and LUKVPress rows ({why}: kvpress pins transformers<5.3)")
    _smoke.skipped("the context from the main interpreter (the real SmolLM2 folder and Wikipedia ids)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
