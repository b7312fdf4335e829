"""An MLP-128 kvzap surrogate trained on log KVzip scores (unweighted: no ||v W_O||) instead of log KVzip+,
same corpus, features, seed and sampling as the shipped one; saved with the shipped profile's LU-KV table."""
import dataclasses, hashlib, sys, tempfile, time
from pathlib import Path
import torch
torch.set_grad_enabled(False)
from safetensors.torch import load_file, save_file
from lukv_cache.models import load_model, max_positions
from lukv_cache.profiling.kvzap_options import KVzapTraining
from lukv_cache.profiling.kvzap import score_thresholds, train_surrogate
from lukv_cache.profiling.scores import prefill_scores
from lukv_cache.profiling.solver import DEFAULT_GRID
from lukv_cache.scorers.kvzap import KVZAP_WINDOW
from lukv_cache.profiles.profile import Profile
from lukv_cache.profiles.index import save_to_local_dir

out = sys.argv[1]
model, tok = load_model("smollm2", threads=2)
training = KVzapTraining()
docs = training.corpus(tok, 0, max_positions(model.config))
work = Path(tempfile.gettempdir()) / "s26"; work.mkdir(exist_ok=True)  # scratch space for the run
cache = work / "kvzip_targets"; cache.mkdir(exist_ok=True)
t0 = time.time()

def targets_of(ids):
    path = cache / (hashlib.sha256(str(ids.tolist()).encode()).hexdigest()[:16] + ".safetensors")
    if path.exists():
        return {int(k): v for k, v in load_file(path).items()}
    scores = prefill_scores(model, ids, "kvzip", tokenizer=tok)
    t = {i: s.clamp_min(1e-12).log().transpose(1, 2).contiguous() for i, s in enumerate(scores) if s is not None}
    save_file({str(k): v for k, v in t.items()}, path)
    print(f"targets {ids.shape[1]} tokens at {time.time() - t0:.0f}s", flush=True)
    return t

with tempfile.TemporaryDirectory(dir=work) as spill:
    sur = train_surrogate(model, tok, docs, family="mlp", features=training.features, samples=512, hidden=128,
                          seed=0, targets_of=targets_of, spill=spill,
                          meta={"corpus": f"{training.describe()} ({len(docs)} documents); KVzip targets, not KVzip+"})
spread = docs[:: max(1, len(docs) // 8)][:8]
sur.meta["thresholds"] = score_thresholds(model, sur, spread, DEFAULT_GRID, KVZAP_WINDOW)
shipped = Profile.load(Path(__file__).resolve().parents[3] / "profiles_hub/HuggingFaceTB/SmolLM2-135M-Instruct/kvzap.safetensors")
print(save_to_local_dir(dataclasses.replace(shipped, surrogate=sur, source=None), out), f"{time.time() - t0:.0f}s")
