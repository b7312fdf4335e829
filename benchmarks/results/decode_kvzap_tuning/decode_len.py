"""Tuning (docs skip=3): kvzap kept scores at fold time, with the surrogate's length input varied."""
import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # benchmarks/
torch.set_grad_enabled(False)
import lukv_cache.scorers.kvzap as kz
from decode_nll import documents, full_nll, cached_nll, METHODS
from lukv_cache.models import load_model

orig = kz._kvzap
MODE = {"v": "base"}

def patched(keys, values, queries, *, surrogate, layer_idx, module, heads, positions, gather_heads=None):
    mode = MODE["v"]
    if mode == "base":
        return orig(keys, values, queries, surrogate=surrogate, layer_idx=layer_idx, module=module, heads=heads, positions=positions, gather_heads=gather_heads)
    attention = None
    if kz.reads_window(surrogate.features):
        attention = kz.module_window_attention(module, keys, queries)
    features = kz.token_features(kz.rope_inverse(module)(keys, positions), values, attention)
    lengths = positions.amax(dim=-1) + 1
    if mode.startswith("fixed"):
        lengths = torch.full_like(lengths, int(mode[5:]))
    out = surrogate.predict(layer_idx, features.flatten(2), heads, lengths)
    if mode == "logt":
        out = out + lengths.float().log()[:, None, None].to(out.device)
    return out

kz._kvzap = patched
model, tok = load_model("smollm2", threads=2)
modes = sys.argv[1:]
docs = documents(tok, 3, 256 + 4096, skip=3)
full = {t: full_nll(model, ids, 256, 256) for t, ids in docs}
print("docs", [t for t, _ in docs], flush=True)
for mode in modes:
    MODE["v"] = mode
    t0 = time.time()
    ex = []
    for t, ids in docs:
        cache = METHODS["kvzap / global"](model, 512, 256, None)
        out = cached_nll(model, ids, 256, cache)
        ex.append(out["nll"] - full[t][0])
    pt = torch.stack(ex).mean(0)
    w = [float(x.mean()) for x in pt.split(512)]
    half = [float(e[:2048].mean()) for e in ex]
    print(f"{mode:10s} all {float(pt.mean()):+.4f} first2k {float(pt[:2048].mean()):+.4f} per-doc {[round(float(e.mean()),4) for e in ex]} w512 {' '.join(f'{x:+.3f}' for x in w)}  {time.time()-t0:.0f}s", flush=True)
