"""LU-KV profiles for kvzap (the shipped MLP surrogate, unchanged) on other calibration sets."""
import sys, time, resource, torch
torch.set_grad_enabled(False)
from lukv_cache import LUKVCache
from lukv_cache.models import load_model
from lukv_cache.profiling import build_profiles
from lukv_cache.profiles.index import save_to_local_dir
from lukv_cache.scorers.kvzap import kvzap_scorer
cal, out = sys.argv[1], sys.argv[2]
model, tok = load_model("smollm2", threads=2)
shipped = LUKVCache.from_pretrained(model, scorer="kvzap", ratio=0.8, local_files_only=True).profile
sur = shipped.surrogate
t0 = time.time()
prof = build_profiles(model, tok, scorers=[kvzap_scorer(sur)], calibration=cal, model_id=shipped.model_id)["kvzap"]
print(cal, "built in", round(time.time() - t0), "s; peak RSS GiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
print(save_to_local_dir(prof, out))
