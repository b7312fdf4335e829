"""Put the KVzip targets computed by kvzip_target_surrogate.py into the build's target cache (same values:
prefill_scores(model, ids, "kvzip", tokenizer=tok).clamp_min(1e-12).log().transpose(1, 2)), after checking
one document against the build's own function with no cache."""
import hashlib, tempfile, torch
torch.set_grad_enabled(False)
from pathlib import Path
from safetensors.torch import load_file
from lukv_cache.models import load_model, max_positions
from lukv_cache.profiling.build import _ResultStore, _sha, cached_kvzip_plus_targets, default_cache_dir, model_fingerprint
from lukv_cache.profiling.kvzap_options import KVzapTraining
model, tok = load_model("smollm2", threads=2)
docs = KVzapTraining().corpus(tok, 0, max_positions(model.config))
mine = Path(tempfile.gettempdir()) / "s26" / "kvzip_targets"  # where kvzip_target_surrogate.py keeps them
def file_of(ids):
    return mine / (hashlib.sha256(str(ids.tolist()).encode()).hexdigest()[:16] + ".safetensors")
fresh = cached_kvzip_plus_targets(model, tok, False, "kvzip")(docs[0])
saved = {int(k): v for k, v in load_file(file_of(docs[0])).items()}
assert sorted(fresh) == sorted(saved)
worst = max(float((fresh[k] - saved[k]).abs().max()) for k in fresh)
print(f"document 0: the build's function and the saved targets differ by at most {worst:.3g} (log scores)")
assert worst < 1e-3
store = _ResultStore(default_cache_dir() / "kvzap")
fp = model_fingerprint(model)
for ids in docs:
    t = load_file(file_of(ids))
    store.save(_sha("kvzip_targets", fp, ids.tolist()), {k: v.numpy() for k, v in t.items()})
print("seeded", len(docs))
