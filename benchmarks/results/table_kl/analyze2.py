# As run: SCRATCH=<scratch> python analyze2.py > analyze2.txt
import os, sys, dataclasses, numpy as np, torch
from lukv_cache.profiles import Profile
from lukv_cache.profiles.memory_table import MemoryTable
import lukv_cache.cache.compression.compressor as comp
from lukv_cache.cache.options.memory import choose_bits
from lukv_cache.profiling.memory_table import DEFAULT_RATIOS
L = 24
cd = dict(np.load(os.environ["SCRATCH"] + "/cell_est.npz")); ld = dict(np.load(os.environ["SCRATCH"] + "/layer_est.npz"))
base = Profile.load(os.environ["SCRATCH"] + "/base.safetensors")
def cells(kind, seeds, wins, T):
    return np.mean([cd[f"s{s}_w{w}_{kind}"][..., :T].mean(-1) for s in seeds for w in range(wins)], axis=0)
def layers(dt, kind, seeds, wins, T):
    return np.mean([ld[f"{dt}_s{s}_w{w}_{kind}"][:, :T].mean(1) for s in seeds for w in range(wins)], axis=0)
def table(c, l):
    return MemoryTable((None, 8, 4), np.asarray(DEFAULT_RATIOS, dtype=np.float32), c.astype(np.float32), layer_loss=l.astype(np.float32))
from lukv_cache.models import load_model
from lukv_cache import LUKVCache
import lukv_cache.testing as Tt
model, tok = load_model("qwen2.5-coder-0.5b", threads=2)
caps = {}
orig = comp.choose_bits
for n in (1000, 4000):
    ids = tok(Tt.prose(12000, seed=11), return_tensors="pt").input_ids[:, :n]
    def spy(*a, **k):
        caps[n] = a; return orig(*a, **k)
    comp.choose_bits = spy
    c = LUKVCache.from_pretrained(base, memory=0.1, config=model.config)
    with torch.no_grad(): model(ids, past_key_values=c, use_cache=True)
comp.choose_bits = orig
MEMS = (0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
def choices(t):
    out = []
    for n in (1000, 4000):
        for mem in MEMS:
            a = list(caps[n]); a[0] = mem; a[6] = t
            ch = choose_bits(*a)
            b = tuple(ch.bits_of(i) for i in range(L))
            out.append((b, round(ch.ratio, 3)))
    return out
def fmt(ch):
    s = []
    for b, r in ch:
        n8 = sum(x == 8 for x in b); n4 = sum(x == 4 for x in b); nn = sum(x is None for x in b)
        s.append(("fp" if nn == L else f"8x{n8}" if n4 == 0 else f"4+{n8}") + f"@{r:.2f}")
    return " ".join(s)
variants = {
  "ref ND (8w T128, layers fp32)": (cells("nd", (0, 1), 4, 128), layers("float32", "nd", (0, 1), 4, 128)),
  "ref KL (8w T128, layers fp32)": (cells("kl", (0, 1), 4, 128), layers("float32", "kl", (0, 1), 4, 128)),
}
for s in (0, 1):
    variants[f"now s{s}: ND 4w T128, layers ND fp32"] = (cells("nd", (s,), 4, 128), layers("float32", "nd", (s,), 4, 128))
    variants[f"ND cells, KL layers bf16 4w T32 s{s}"] = (cells("nd", (s,), 4, 128), layers("bfloat16", "kl", (s,), 4, 32))
    for w, T in ((4, 128), (4, 64), (4, 32), (2, 64), (2, 32), (1, 64)):
        variants[f"KL {w}w T{T} (layers bf16 same) s{s}"] = (cells("kl", (s,), w, T), layers("bfloat16", "kl", (s,), w, min(T, 32) if T < 128 else 32))
print("columns: 1k then 4k at memory", MEMS)
for name, (c, l) in variants.items():
    print(f"{name:44s}", fmt(choices(table(c, l))))
for name in list(variants)[:4]:
    print(name, "cells:\n", np.round(variants[name][0], 3))
