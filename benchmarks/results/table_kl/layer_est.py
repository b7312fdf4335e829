# As run (2026-12-07, on 08509cb plus nothing: the table code of the time), scratch folder as $SCRATCH:
# SCRATCH=<scratch> python layer_est.py <scratch>/base.safetensors 2 0,1 float32,bfloat16 <scratch>/layer_est.npz
"""Per-layer 4-bit loss estimators: NLL difference (current) vs KL(p8 || p_layer4), per token, fp32 and bf16,
on two window seeds. Saves per-token arrays."""
import os, sys, time, numpy as np, torch
from typing import Any, cast
from lukv_cache.models import load_model
from lukv_cache.profiles import Profile
from lukv_cache.cache import LUKVCache
from lukv_cache.cache.compression.recorded import RecordedPrefill
from lukv_cache.profiling.memory_table import _windows, window_context_tokens, calibration_texts, _LayerOutputs
from lukv_cache.profiling.table_dtype import model_in
from lukv_cache._compat import cache_kwarg

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
model, tok = load_model("qwen2.5-coder-0.5b")
model.eval()
profile = Profile.load(sys.argv[1])
texts = calibration_texts("planted")
ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
C = window_context_tokens([len(i) for i in ids], 4, 128, None)
L = model.config.num_hidden_layers
seeds = [int(s) for s in (sys.argv[3].split(",") if len(sys.argv) > 3 else ["0", "1"])]
dtypes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["float32", "bfloat16"]
out = {}

def cache(bits, at4=None):
    c = LUKVCache.from_pretrained(profile, 0.0, kv_bits=bits, config=model.config)
    if at4 is not None:
        cast(Any, c.layers[at4]).kv_bits = 4
    return c

def logits_of(m, c, rec, target):
    torch.manual_seed(0)
    rec.replay_into(c)
    last = cast(torch.Tensor, rec.last_logits)
    lg = m(input_ids=target[:, :-1], use_cache=True, **{cache_kwarg(m): c}).logits
    return torch.cat([last[:, None, :].to(lg.dtype), lg], dim=1).float()[0]

with torch.no_grad():
    for dt in dtypes:
        with model_in(model, getattr(torch, dt)) as m:
            for seed in seeds:
                wins = _windows(ids, 4, C + 128, np.random.default_rng(seed))
                for w, win in enumerate(wins):
                    t0 = time.perf_counter()
                    x = torch.tensor([win])
                    ctx, tgt = x[:, :C], x[:, C:]
                    rec = RecordedPrefill.record(m, ctx, 128)
                    below = _LayerOutputs(m)
                    with below.record():
                        l8 = logits_of(m, cache(8), rec, tgt)
                    lp8 = torch.log_softmax(l8, -1)
                    nll8 = -lp8.gather(1, tgt[0][:, None])[:, 0]
                    nd = np.zeros((L, 128)); kl = np.zeros((L, 128))
                    for layer in range(L):
                        with below.reused_below(layer):
                            ll = logits_of(m, cache(8, layer), rec, tgt)
                        lpl = torch.log_softmax(ll, -1)
                        nd[layer] = (-lpl.gather(1, tgt[0][:, None])[:, 0] - nll8).numpy()
                        kl[layer] = (lp8.exp() * (lp8 - lpl)).sum(-1).numpy()
                    out[f"{dt}_s{seed}_w{w}_nd"] = nd
                    out[f"{dt}_s{seed}_w{w}_kl"] = kl
                    print(dt, seed, w, f"{time.perf_counter()-t0:.1f}s", "nd", np.round(nd.mean(1), 3)[:8], "kl", np.round(kl.mean(1), 4)[:8], flush=True)
                    np.savez(sys.argv[5] if len(sys.argv) > 5 else os.environ["SCRATCH"] + "/layer_est.npz", **out)
