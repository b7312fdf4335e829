"""Each layer's 4-bit loss from one backward pass per window, as run for issue 58 (the code of c73bc7b).

The continuation's NLL (128 tokens after a 1,070-token window of `planted`, the memory table's windows for
seeds 0 and 1) is differentiated with respect to every layer's keys and values, at the 8-bit cache's values
(MID=0: first order) or at the midpoint of the 8- and 4-bit caches' (MID=1), and dotted with the 4-bit
minus 8-bit difference: one estimate per layer and window. NSAMP > 0 adds a sampled-label Fisher estimate
of the second order (one more backward pass per sample). PREFILL_DTYPE: the window's prefill (the keys and
values) in another precision than the gradient's pass.

    python grad_est.py PROFILE THREADS SEEDS DTYPE NSAMP OUT.npz MID [PREFILL_DTYPE]

first_order_fp32.npz:  <profile> 2 0,1 float32 2 first_order_fp32.npz 0   (an earlier copy without MID: 0)
midpoint_fp32.npz:     <profile> 2 0,1 float32 0 midpoint_fp32.npz 1
midpoint_bf16.npz:     <profile> 2 0,1 bfloat16 0 midpoint_bf16.npz 1
midpoint_fp32_over_bf16_prefill.npz: <profile> 2 0,1 float32 0 midpoint_fp32_over_bf16_prefill.npz 1 bfloat16

<profile>: the keydiff profile of 08509cb (the table_kl record's; at ratio 0 only its cache settings matter).
"""
import sys, time, numpy as np, torch
from typing import Any, cast
from transformers import DynamicCache
from lukv_cache.models import load_model
from lukv_cache.profiles import Profile
from lukv_cache.cache import LUKVCache
from lukv_cache.cache.compression.recorded import RecordedPrefill
from lukv_cache.profiling.memory_table import _windows, window_context_tokens, calibration_texts
from lukv_cache.profiling.table_dtype import model_in
from lukv_cache._compat import cache_kwarg

torch.set_num_threads(int(sys.argv[2]))
model, tok = load_model("qwen2.5-coder-0.5b")
model.eval()
for p in model.parameters():
    p.requires_grad_(False)
profile = Profile.load(sys.argv[1])
texts = calibration_texts("planted")
ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
CT = 128
C = window_context_tokens([len(i) for i in ids], 4, CT, None)
L = model.config.num_hidden_layers
seeds = [int(s) for s in sys.argv[3].split(",")]
dt = getattr(torch, sys.argv[4])
nsamp = int(sys.argv[5])
MID = int(sys.argv[7])
pdt = getattr(torch, sys.argv[8]) if len(sys.argv) > 8 else dt
out = {}

def views(rec, bits):
    c = LUKVCache.from_pretrained(profile, 0.0, kv_bits=bits, config=pm.config)
    torch.manual_seed(0)
    rec.replay_into(c)
    return [(l.keys.detach().to(dt), l.values.detach().to(dt)) for l in c.layers]

with model_in(model, dt) as m, model_in(model, pdt) as pm:
    for seed in seeds:
        wins = _windows(ids, 4, C + CT, np.random.default_rng(seed))
        for w, win in enumerate(wins):
            t0 = time.perf_counter()
            x = torch.tensor([win])
            ctx, tgt = x[:, :C], x[:, C:]
            with torch.no_grad():
                rec = RecordedPrefill.record(pm, ctx, CT)
                v8, v4 = views(rec, 8), views(rec, 4)
            t1 = time.perf_counter()
            mids = [((k8 + k4) / 2, (vv8 + vv4) / 2) for (k8, vv8), (k4, vv4) in zip(v8, v4)] if MID else v8
            leaves = [(k.detach().clone().requires_grad_(True), v.detach().clone().requires_grad_(True)) for k, v in mids]
            def run(labels):
                cache = DynamicCache(config=m.config)
                for i, (k, v) in enumerate(leaves):
                    cache.update(k, v, i)
                lg = m(input_ids=tgt[:, :-1], use_cache=True, **{cache_kwarg(m): cache}).logits[0].float()
                return lg
            lg = run(None)
            nll = torch.nn.functional.cross_entropy(lg, tgt[0, 1:], reduction="sum") / CT
            grads = torch.autograd.grad(nll, [t for kv in leaves for t in kv])
            first = np.array([float((grads[2*i].float()*(v4[i][0]-v8[i][0]).float()).sum() + (grads[2*i+1].float()*(v4[i][1]-v8[i][1]).float()).sum()) for i in range(L)])
            t2 = time.perf_counter()
            fisher = np.zeros((nsamp, L))
            for s in range(nsamp):
                lg = run(None)
                g = torch.Generator().manual_seed(1000 * seed + 10 * w + s)
                y = torch.multinomial(torch.softmax(lg.detach(), -1), 1, generator=g)[:, 0]
                lp = -torch.nn.functional.cross_entropy(lg, y, reduction="sum")
                gr = torch.autograd.grad(lp, [t for kv in leaves for t in kv])
                fisher[s] = [float((gr[2*i].float()*(v4[i][0]-v8[i][0]).float()).sum() + (gr[2*i+1].float()*(v4[i][1]-v8[i][1]).float()).sum())**2 for i in range(L)]
            t3 = time.perf_counter()
            out[f"s{seed}_w{w}_first"] = first
            out[f"s{seed}_w{w}_fisher"] = fisher / CT / 2  # ~ mean KL per token
            print(seed, w, f"views {t1-t0:.1f}s grad {t2-t1:.1f}s fisher {t3-t2:.1f}s", np.round(first[:8], 4), flush=True)
            np.savez(sys.argv[6], **out)
