# As run: SCRATCH=<scratch> python analyze.py <scratch>/layer_est.npz <scratch>/base.safetensors > analyze.txt
"""Compare per-layer estimators: the widths memory= picks at 1k (choose_bits with captured shapes)."""
import os, sys, dataclasses, numpy as np, torch
from lukv_cache.profiles import Profile
from lukv_cache.profiles.memory_table import MemoryTable
import lukv_cache.cache.compression.compressor as comp
from lukv_cache.cache.options.memory import choose_bits
d = dict(np.load(sys.argv[1]))
base = Profile.load(sys.argv[2])
cells = base.memory_table
L = 24
def vec(dt, kind, seed, wins=4, T=128):
    return np.mean([d[f"{dt}_s{seed}_w{w}_{kind}"][:, :T].mean(1) for w in range(wins)], axis=0)
ref = np.mean([vec("float32", "kl", s) for s in (0, 1)], axis=0)
print("reference KL fp32 8 windows:", np.round(ref, 4))
print("order", np.argsort(-ref)[:10])
# captured shapes
import pickle
cap = None
try:
    from lukv_cache.models import load_model
    from lukv_cache import LUKVCache
    import lukv_cache.testing as Tt
    model, tok = load_model("qwen2.5-coder-0.5b", threads=2)
    ids = tok(Tt.prose(3000, seed=11), return_tensors="pt").input_ids[:, :1000]
    orig = comp.choose_bits
    def spy(*a, **k):
        global cap; cap = a; return orig(*a, **k)
    comp.choose_bits = spy
    c = LUKVCache.from_pretrained(base, memory=0.1, config=model.config)
    with torch.no_grad(): model(ids, past_key_values=c, use_cache=True)
    comp.choose_bits = orig
finally:
    pass
def widths(layer_loss):
    t = dataclasses.replace(cells, layer_loss=np.asarray(layer_loss, dtype=np.float32))
    out = []
    for mem in (0.075, 0.1, 0.15, 0.2):
        a = list(cap); a[0] = mem; a[6] = t
        ch = choose_bits(*a)
        b = tuple(ch.bits_of(i) for i in range(L))
        out.append(frozenset(i for i, x in enumerate(b) if x == 8))
    return out
R = widths(ref)
def show(name, v):
    w = widths(v)
    rho = np.corrcoef(np.argsort(np.argsort(-v)), np.argsort(np.argsort(-ref)))[0, 1]
    top5 = len(set(np.argsort(-v)[:5]) & set(np.argsort(-ref)[:5]))
    print(f"{name:32s} n8 {[len(s) for s in w]} sym-diff vs ref {[len(a ^ b) for a, b in zip(w, R)]} spearman {rho:+.2f} top5 {top5} sum {v.clip(0).sum():.4f}")
print("reference widths", [sorted(s) for s in R])
show("base table (in profile)", cells.layer_loss)
for dt in ("float32", "bfloat16"):
    if f"{dt}_s0_w0_kl" not in d: continue
    for kind in ("nd", "kl"):
        for wins, T in ((4, 128), (2, 128), (4, 32), (2, 32), (2, 64), (1, 64), (4, 16)):
            for s in (0, 1):
                show(f"{dt} {kind} w{wins} T{T} seed{s}", vec(dt, kind, s, wins, T))
