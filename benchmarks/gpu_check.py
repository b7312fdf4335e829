"""GPU check of the ragged cache on Llama-3.1-8B's shape (random bf16 weights, nothing downloaded).

1. Correctness: the fused ragged-attention kernels (Triton, and flash-attn when installed) against the
   torch reference computed on CPU from the same bf16 inputs; then a whole model decoding with
   ``LUKVCache`` through the fused kernel against the same run forced onto the torch reference.
2. At each context and the ratio: peak GPU memory for prefill + N decode steps, time to first token and
   decode ms/token, for ``DynamicCache``, ``LUKVCache(ratio, scorer="keydiff", allocator="uniform")``, and
   a ``DynamicCache`` holding as many tokens per head as the LUKVCache keeps (the ragged path's overhead).

Prints one table last and writes every number to a JSON file (rewritten after each run, so a run cut
short still leaves what it measured).

    python benchmarks/gpu_check.py --device cuda --out gpu_check.json
    python benchmarks/gpu_check.py --toy --device cpu --out /tmp/gpu_check_toy.json   # CI, seconds

``--smoke``: the toy model (``--toy``) at a 64-token context, 2 decode steps, on CUDA when torch sees a
device, else on CPU; the report in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import _smoke
import torch
from _calls import cache_kw
from _out import default_out

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
if not torch.cuda.is_available() and "triton" not in sys.modules:
    # CPU runs check the Triton kernel in Triton's interpreter, which only works if this is set before
    # triton is first imported (importing transformers' modeling utils imports it when installed).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import lukv_cache  # noqa: E402  (wraps sdpa/eager so LUKVCache works with the stock model)
from lukv_cache import LUKVCache  # noqa: E402
from lukv_cache.attention import kernels as ragged_cuda  # noqa: E402
from lukv_cache.attention.dispatch import ragged_attention  # noqa: E402
from lukv_cache.attention.partial import ragged_attention_reference  # noqa: E402

GIB = 1024**3
# Relative L2 error of bf16 attention outputs vs an fp32 reference: bf16 has an 8-bit mantissa
# (2^-9 ~ 2e-3 per rounding); probabilities rounded to bf16 before P @ V add a few of those.
OUT_RTOL = 2e-2
LSE_ATOL = 2e-2
LOGITS_RTOL = 5e-2


def llama_8b_config(toy: bool, max_positions: int):
    """Llama-3.1-8B's shape (``toy``: a tiny model of the same family for CPU runs)."""
    from transformers import LlamaConfig

    if toy:
        return LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=max(max_positions, 4096),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=max(max_positions, 131072),
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def build_model(config, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: 8B parameters are slow to init on CPU
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class KernelCalls:
    """Counts which ragged kernel each dispatcher call got (so the report says what really ran):
    ``get_ragged_kernel`` (store only; ``+bias`` when a key bias was passed) and, if the cache uses it,
    ``get_ragged_suffix_kernel`` (store + suffix fused, ``fused:`` prefix)."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self._store = ragged_cuda.get_ragged_kernel
        self._fused = ragged_cuda.get_ragged_suffix_kernel

    def __enter__(self):
        def store(query, key_bias=None, softcap=None):
            name = ragged_cuda.ragged_kernel_name(query, key_bias=key_bias, softcap=softcap)
            self.counts[name + ("+bias" if key_bias is not None else "")] += 1
            return self._store(query, key_bias=key_bias, softcap=softcap)

        def fused(query):
            fn = self._fused(query)
            self.counts["fused:" + ("triton" if fn is not None else "none")] += 1
            return fn

        ragged_cuda.get_ragged_kernel, ragged_cuda.get_ragged_suffix_kernel = store, fused
        return self

    def __exit__(self, *exc):
        ragged_cuda.get_ragged_kernel, ragged_cuda.get_ragged_suffix_kernel = self._store, self._fused


# ---------------------------------------------------------------------------------------------- checks
def _import_or_none(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, but also broken CUDA builds that fail while loading
        return None


def _backend_importable(name: str) -> bool:
    module = _import_or_none(name)
    if name == "flash_attn":
        return getattr(module, "flash_attn_varlen_func", None) is not None
    return module is not None


def _random_store(b, h, group, q_len, d, lengths, device, seed):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(b * h + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    n = int(offsets[-1])
    query = torch.randn(b, h, group * q_len, d, generator=gen).to(torch.bfloat16)
    keys = (torch.randn(n, d, generator=gen) * 2.0).to(torch.bfloat16)  # logits of a few units: peaky rows
    values = torch.randn(n, d, generator=gen).to(torch.bfloat16)
    return query.to(device), keys.to(device), values.to(device), offsets.to(device)


def _compare(out, lse, ref_out, ref_lse, empty: list[bool], h) -> dict:
    out, lse = out.float().cpu(), lse.float().cpu()
    empty = torch.tensor(empty).view(-1, h)  # [B, H]: segments with nothing to attend
    full = ~empty
    rel = ((out - ref_out)[full].norm() / ref_out[full].norm().clamp_min(1e-30)).item()
    lse_err = (lse - ref_lse)[full].abs().max().item() if bool(full.any()) else 0.0
    empty_ok = bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    ok = rel < OUT_RTOL and lse_err < LSE_ATOL and empty_ok and not nan
    return {
        "rel_err_out": rel,
        "max_abs_err_lse": lse_err,
        "empty_segments_ok": empty_ok,
        "nan": nan,
        "ok": ok,
    }


def kernel_check(device: torch.device, toy: bool) -> list[dict]:
    """Each fused kernel usable here vs the fp32 torch reference on CPU, on ragged stores of 8B's shape.

    Store-only cases go through ``ragged_attention`` (forced onto each backend, then its default
    choice); ``suffix`` cases through the fused store + suffix call of ``get_ragged_suffix_kernel``.
    On CPU the Triton kernel runs in Triton's interpreter when triton is installed.
    """
    b, h, group, d = (2, 4, 2, 16) if toy else (2, 8, 4, 128)
    long = 300 if toy else 40_000
    gen = torch.Generator().manual_seed(1)
    lengths = [0, 1, 63, 64, 65, long] + torch.randint(0, 2 * long // 3, (b * h - 6,), generator=gen).tolist()
    lengths[-1] = 0  # an empty segment in the second row too
    cases = [
        {"name": "decode", "q_len": 1, "softcap": None, "bias": False, "suffix": None},
        {"name": "decode_softcap", "q_len": 1, "softcap": 30.0, "bias": False, "suffix": None},
        {"name": "chunk_q5_bias", "q_len": 5, "softcap": None, "bias": True, "suffix": None},
        {"name": "decode_suffix", "q_len": 1, "softcap": None, "bias": False, "suffix": 37},
        {"name": "chunk_q3_suffix_bias", "q_len": 3, "softcap": None, "bias": True, "suffix": 40},
    ]
    interpreter = (
        device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _backend_importable("triton")
    )
    if device.type == "cuda":
        store_backends = [name for name in ("triton", "flash_attn") if _backend_importable(name)] + [
            "dispatch"
        ]
    else:
        store_backends = (["triton_interpreter"] if interpreter else []) + ["dispatch"]
    results = []
    for i, case in enumerate(cases):
        query, keys, values, offsets = _random_store(
            b, h, group, case["q_len"], d, lengths, device, seed=10 + i
        )
        gen_b = torch.Generator().manual_seed(20 + i)
        m, s = group * case["q_len"], case["suffix"]
        bias = suffix_bias = suffix_k = suffix_v = None
        if case["bias"]:
            bias = _masked_bias((keys.shape[0], case["q_len"]), gen_b).to(device)
            if s is not None:
                suffix_bias = _masked_bias((b, 1, m, s), gen_b).to(device)
        if s is not None:  # views into a longer buffer, like the cache's suffix
            suffix_k = (
                (torch.randn(b, h, s + 8, d, generator=gen_b) * 2).to(torch.bfloat16).to(device)[:, :, :s]
            )
            suffix_v = torch.randn(b, h, s + 8, d, generator=gen_b).to(torch.bfloat16).to(device)[:, :, :s]
        kw = {"scaling": d**-0.5, "softcap": case["softcap"]}
        cpu = [t.cpu().float() for t in (query, keys, values)]
        if s is None:
            ref_out, ref_lse = ragged_attention_reference(
                *cpu, offsets.cpu(), key_bias=None if bias is None else bias.cpu(), **kw
            )
            backends = store_backends
        else:
            ref_out, ref_lse = ragged_cuda.ragged_with_suffix_reference(
                *cpu, offsets.cpu(), suffix_k.cpu().float(), suffix_v.cpu().float(),
                key_bias=None if bias is None else bias.cpu(),
                suffix_bias=None if suffix_bias is None else suffix_bias.cpu(), **kw,
            )  # fmt: skip
            backends = ["triton_fused"] if (device.type == "cuda" or interpreter) else []
        for backend in backends:
            if backend == "flash_attn" and bias is not None:
                continue  # flash-attn takes no bias; the dispatcher sends those calls elsewhere
            try:
                if backend == "triton_fused":
                    # on CPU: Triton's interpreter, which the dispatcher takes only when the kernel is forced
                    cpu = device.type == "cpu"
                    with _env(ragged_cuda.KERNEL_ENV, "triton") if cpu else contextlib.nullcontext():
                        fused = ragged_cuda.get_ragged_suffix_kernel(query)
                    if fused is None:
                        raise RuntimeError(f"get_ragged_suffix_kernel returned None on {device.type}")
                    out, lse = fused(
                        query,
                        keys,
                        values,
                        offsets,
                        suffix_k,
                        suffix_v,
                        key_bias=bias,
                        suffix_bias=suffix_bias,
                        **kw,
                    )
                    used = "triton_fused" if ragged_cuda.triton_failure() is None else "torch (triton failed)"
                elif backend == "triton_interpreter":
                    from lukv_cache.attention._triton_ragged import triton_ragged_attention

                    out, lse = triton_ragged_attention(query, keys, values, offsets, key_bias=bias, **kw)
                    used = "triton_interpreter"
                else:
                    forced = None if backend == "dispatch" else backend
                    with _env(ragged_cuda.KERNEL_ENV, forced):
                        used = ragged_cuda.ragged_kernel_name(query, key_bias=bias, softcap=case["softcap"])
                        out, lse = ragged_attention(query, keys, values, offsets, key_bias=bias, **kw)
                _sync(device)
                empty = [n == 0 and not s for n in lengths]
                row = {"case": case["name"], "backend": backend, "used": used}
                row.update(_compare(out, lse, ref_out, ref_lse, empty, h))
            except Exception as exc:  # report and keep going: one broken backend must not hide the others
                row = {
                    "case": case["name"],
                    "backend": backend,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            results.append(row)
    failure = ragged_cuda.triton_failure()
    if failure is not None:
        results.append({"case": "triton_runtime", "backend": "triton", "ok": False, "error": failure})
    return results


def _masked_bias(shape, gen) -> torch.Tensor:
    bias = torch.randn(shape, generator=gen)
    bias[torch.rand(shape, generator=gen) < 0.3] = torch.finfo(torch.float32).min  # as the cache masks
    return bias


@torch.no_grad()
def _greedy_logits(model, ids, cache, steps: int) -> torch.Tensor:
    out = model(input_ids=ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
    logits = [out.logits[:, -1].float()]
    for _ in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=tok, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)  # [B, steps + 1, V]


def model_check(model, device: torch.device, context: int, ratio: float, steps: int) -> dict:
    """Decode with LUKVCache through the default kernel vs forced onto the torch reference."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    runs = {}
    calls = {}
    for label, forced in (("default", None), ("torch", "torch")):
        with _env(ragged_cuda.KERNEL_ENV, forced), KernelCalls() as counter:
            cache = LUKVCache(ratio=ratio, scorer="keydiff", allocator="uniform", config=model.config)
            runs[label] = _greedy_logits(model, ids, cache, steps).cpu()
        calls[label] = dict(counter.counts)
        del cache
        _free(device)
    a, ref = runs["default"], runs["torch"]
    rel = ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    nan = bool(torch.isnan(a).any())
    agree = (a.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {
        "context": context,
        "decode_steps": steps,
        "rel_err_logits": rel,
        "greedy_agreement": agree,
        "nan": nan,
        "kernel_calls": calls,
        "ok": rel < LOGITS_RTOL and not nan,
    }


# ---------------------------------------------------------------------------------------------- timing
def _dynamic_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def _tokens_per_head(cache) -> float:
    if isinstance(cache, LUKVCache):
        return cache.stored_tokens().float().mean().item()
    return float(cache.get_seq_length())


@torch.no_grad()
def measure(model, make_cache, context: int, decode_steps: int, device: torch.device, label: str) -> dict:
    """Prefill ``context`` random tokens, then ``decode_steps`` greedy steps; memory and times."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    row = {"label": label, "context": context, "decode_steps": decode_steps}
    cache = make_cache()
    with KernelCalls() as counter:
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        row["ttft_s"] = time.perf_counter() - start
        row["tokens_per_head_after_prefill"] = _tokens_per_head(cache)
        timed = decode_steps
        if decode_steps > 1:  # one untimed step: a first-call kernel compile is not decode time
            out = model(input_ids=tok, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            timed = decode_steps - 1
        _sync(device)
        start = time.perf_counter()
        for _ in range(timed):
            out = model(input_ids=tok, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        row["decode_ms_per_token"] = (time.perf_counter() - start) / max(timed, 1) * 1000
    row["kernel_calls"] = dict(counter.counts)
    row["cache_bytes"] = cache.memory_bytes() if isinstance(cache, LUKVCache) else _dynamic_bytes(cache)
    row["tokens_per_head_end"] = _tokens_per_head(cache)
    row["nan_logits"] = bool(torch.isnan(out.logits).any())
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_above_weights_bytes"] = row["peak_bytes"] - base
    del cache, out
    _free(device)
    return row


def _guarded(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except torch.cuda.OutOfMemoryError as exc:
        _free(torch.device("cuda"))
        return {"label": kwargs.get("label", "?"), "error": f"OutOfMemoryError: {str(exc)[:300]}"}


# ---------------------------------------------------------------------------------------------- report
def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def summarize(rows: list[dict]) -> list[dict]:
    """Per context: the ragged path's decode overhead (LUKVCache vs a uniform DynamicCache holding as
    many tokens per head) and the peak memory of DynamicCache vs LUKVCache."""
    out = []
    for ctx in sorted({r["context"] for r in rows}):
        by = {r["label"].split("(")[0]: r for r in rows if r["context"] == ctx and "error" not in r}
        lukv, uni, dyn = by.get("LUKVCache"), by.get("DynamicCache-uniform"), by.get("DynamicCache")
        entry: dict = {"context": ctx}
        if lukv and uni:
            entry["ragged_decode_overhead"] = lukv["decode_ms_per_token"] / uni["decode_ms_per_token"]
        if lukv and dyn and lukv.get("peak_bytes") and dyn.get("peak_bytes"):
            entry["peak_gib_dynamic"] = dyn["peak_bytes"] / GIB
            entry["peak_gib_lukv"] = lukv["peak_bytes"] / GIB
        out.append(entry)
    return out


def table(rows: list[dict], summary: list[dict]) -> str:
    head = f"{'context':>8}  {'cache':<28} {'peak GiB':>9} {'cache GiB':>9} {'tok/head':>9} {'TTFT s':>8} {'ms/tok':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['context']:>8}  {r['label']:<28} {r['error']}")
            continue
        peak = r.get("peak_bytes")
        lines.append(
            f"{r['context']:>8}  {r['label']:<28} {_fmt(peak / GIB if peak else None, '9.2f')} "
            f"{r['cache_bytes'] / GIB:9.3f} {r['tokens_per_head_end']:9.0f} {r['ttft_s']:8.2f} "
            f"{r['decode_ms_per_token']:8.2f}"
        )
    for entry in summary:
        notes = []
        if "ragged_decode_overhead" in entry:
            notes.append(f"ragged decode overhead {entry['ragged_decode_overhead']:.2f}x (target <= 1.15x)")
        if "peak_gib_lukv" in entry:
            notes.append(f"peak {entry['peak_gib_dynamic']:.1f} -> {entry['peak_gib_lukv']:.1f} GiB")
        if notes:
            lines.append(f"{entry['context']:>8}  " + "; ".join(notes))
    return "\n".join(lines)


def _environment(device: torch.device) -> dict:
    env = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "lukv_cache": getattr(lukv_cache, "__version__", "?"),
    }
    for name in ("triton", "flash_attn", "transformers"):
        module = _import_or_none(name)
        env[name] = getattr(module, "__version__", None) if module is not None else None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        probe = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16, device=device)
        env["ragged_kernel"] = ragged_cuda.ragged_kernel_name(probe)
    else:
        env["ragged_kernel"] = "torch"
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="default 32768 131072 (toy: 128 256)"
    )
    parser.add_argument("--ratio", type=float, default=0.8, help="fraction of the prompt's KV removed")
    parser.add_argument("--decode-steps", type=int, default=None, help="default 64 (toy: 4)")
    parser.add_argument(
        "--toy", action="store_true", help="tiny model of the same family: runs on CPU in seconds"
    )
    parser.add_argument(
        "--check-context", type=int, default=None, help="model check context (default 4096, toy 128)"
    )
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--out", type=Path, default=default_out("gpu_check") / "gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.out = _smoke.begin(stand_ins=False).out("gpu_check.json")
        args.toy, args.contexts, args.decode_steps = True, [64], 2
        args.check_context, args.skip_check = 64, False
    args.contexts = args.contexts or ([128, 256] if args.toy else [32768, 131072])
    args.decode_steps = args.decode_steps if args.decode_steps is not None else (4 if args.toy else 64)
    args.check_context = args.check_context or (128 if args.toy else 4096)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if device.type == "cpu" and args.toy:
        # A toy model gains nothing from intra-op threads, and on a busy machine their barriers turn a
        # 1 ms decode step into hundreds of ms.
        torch.set_num_threads(1)
    if args.smoke:
        if device.type == "cpu":
            _smoke.skipped(
                "the GPU: no CUDA device, so the toy model on CPU (Llama-3.1-8B's shape needs one)"
            )
            if not _backend_importable("triton"):
                _smoke.skipped(
                    "the Triton kernel's checks: triton is not installed (pip install -e '.[gpu-test]')"
                )
        elif not _backend_importable("flash_attn"):
            _smoke.skipped("flash-attn's kernel: flash-attn is not installed")
    started = time.perf_counter()
    report: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    report["environment"] = _environment(device)

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))

    print(f"environment: {json.dumps(report['environment'])}", flush=True)
    ok = True
    if not args.skip_check:
        report["kernel_check"] = kernel_check(device, args.toy)
        for r in report["kernel_check"]:
            print(
                f"kernel check {r['case']:<15} {r['backend']:<19} "
                + (
                    f"rel_err_out={r['rel_err_out']:.2e} lse_err={r['max_abs_err_lse']:.2e} "
                    f"empty_ok={r['empty_segments_ok']} nan={r['nan']} -> {'ok' if r['ok'] else 'FAIL'}"
                    if "error" not in r
                    else f"FAIL {r['error']}"
                ),
                flush=True,
            )
        ok &= all(r["ok"] for r in report["kernel_check"])
        save()

    config = llama_8b_config(args.toy, max(args.contexts) + args.decode_steps + 8)
    t = time.perf_counter()
    # bf16 on the GPU (the real setting); fp32 for CPU toy runs, where bf16 matmuls are ~10x slower.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report["model_dtype"] = str(dtype)
    model = build_model(config, device, dtype)
    report["model_build_s"] = time.perf_counter() - t
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, built in "
        f"{report['model_build_s']:.1f}s",
        flush=True,
    )

    if not args.skip_check:
        report["model_check"] = _guarded(model_check, model, device, args.check_context, args.ratio, 4)
        mc = report["model_check"]
        print(f"model check: {json.dumps(mc)}", flush=True)
        ok &= bool(mc.get("ok"))
        save()

    if device.type == "cuda":  # warm-up at a small context (kernel compiles, cuBLAS handles), not reported
        warm = min(2048, min(args.contexts))
        measure(
            model,
            lambda: LUKVCache(ratio=args.ratio, scorer="keydiff", allocator="uniform", config=config),
            warm,
            3,
            device,
            "warmup",
        )
        measure(model, lambda: _dynamic_cache(config), warm, 3, device, "warmup")

    rows = report.setdefault("runs", [])

    def run(label: str, make_cache, ctx: int, prefill: int) -> dict:
        row = _guarded(measure, model, make_cache, prefill, args.decode_steps, device, label=label)
        row.update(context=ctx, prefill_tokens=prefill)  # the uniform run is grouped under its context
        rows.append(row)
        save()
        return row

    for ctx in args.contexts:
        run("DynamicCache", lambda: _dynamic_cache(config), ctx, ctx)
        lukv = run(
            f"LUKVCache(ratio={args.ratio})",
            lambda: LUKVCache(ratio=args.ratio, scorer="keydiff", allocator="uniform", config=config),
            ctx,
            ctx,
        )
        if "error" not in lukv:
            kept = max(1, round(lukv["tokens_per_head_after_prefill"]))
            run(f"DynamicCache-uniform({kept})", lambda: _dynamic_cache(config), ctx, kept)
    ok &= all(not r.get("nan_logits", False) for r in rows)

    report["summary"] = summarize(rows)
    report["triton_failure"] = ragged_cuda.triton_failure()
    report["ok"] = bool(ok)
    save()
    print(f"\nwrote {args.out} ({time.perf_counter() - started:.1f}s, ok={report['ok']})\n")
    print(table(rows, report["summary"]))
    return 0 if ok else 1


def _dynamic_cache(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)


if __name__ == "__main__":
    sys.exit(main())
