# As run: SCRATCH=<scratch> python cell_est.py <scratch>/base.safetensors (base: `lukv build qwen2.5-coder-0.5b --scorer keydiff` at 08509cb)
"""Per-token NLL difference and KL(full || cell) for every table cell, bf16, two window seeds."""
import os, sys, time, numpy as np, torch
from typing import cast
from lukv_cache.models import load_model
from lukv_cache.profiles import Profile
from lukv_cache.cache import LUKVCache
from lukv_cache.cache.compression.recorded import RecordedPrefill
from lukv_cache.profiling.memory_table import _windows, window_context_tokens, calibration_texts, DEFAULT_RATIOS, DEFAULT_BITS
from lukv_cache.profiling.table_dtype import model_in
from lukv_cache._compat import cache_kwarg
torch.set_num_threads(2)
model, tok = load_model("qwen2.5-coder-0.5b"); model.eval()
profile = Profile.load(sys.argv[1])
ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in calibration_texts("planted")]
C = window_context_tokens([len(i) for i in ids], 4, 128, None)
out = {}
def logits_of(m, c, rec, tgt):
    torch.manual_seed(0)
    if c is None:
        c = rec.full_cache(m.config)
    else:
        rec.replay_into(c)
    last = cast(torch.Tensor, rec.last_logits)
    lg = m(input_ids=tgt[:, :-1], use_cache=True, **{cache_kwarg(m): c}).logits
    return torch.log_softmax(torch.cat([last[:, None, :].to(lg.dtype), lg], dim=1).float()[0], -1)
with torch.no_grad(), model_in(model, torch.bfloat16) as m:
    for seed in (0, 1):
        for w, win in enumerate(_windows(ids, 4, C + 128, np.random.default_rng(seed))):
            t0 = time.perf_counter()
            x = torch.tensor([win]); ctx, tgt = x[:, :C], x[:, C:]
            rec = RecordedPrefill.record(m, ctx, 128)
            lpf = logits_of(m, None, rec, tgt)
            nllf = -lpf.gather(1, tgt[0][:, None])[:, 0]
            nd = np.zeros((3, 6, 128)); kl = np.zeros((3, 6, 128))
            for i, b in enumerate(DEFAULT_BITS):
                for j, r in enumerate(DEFAULT_RATIOS):
                    lp = logits_of(m, LUKVCache.from_pretrained(profile, r, kv_bits=b, config=m.config), rec, tgt)
                    nd[i, j] = (-lp.gather(1, tgt[0][:, None])[:, 0] - nllf).numpy()
                    kl[i, j] = (lpf.exp() * (lpf - lp)).sum(-1).numpy()
            out[f"s{seed}_w{w}_nd"] = nd; out[f"s{seed}_w{w}_kl"] = kl
            print(seed, w, f"{time.perf_counter()-t0:.1f}s", np.round(nd.mean(-1), 3).tolist(), np.round(kl.mean(-1), 3).tolist(), flush=True)
            np.savez(os.environ["SCRATCH"] + "/cell_est.npz", **out)
