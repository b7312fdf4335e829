import torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # benchmarks/
torch.set_grad_enabled(False); torch.set_num_threads(2)
from decode_nll import documents
from lukv_cache import LUKVCache
from lukv_cache.models import load_model
model, tok = load_model("smollm2", threads=2)
docs = documents(tok, 1, 2048, skip=3)
cache = LUKVCache.from_pretrained(model, scorer="kvzap", allocator="global", ratio=0.8, local_files_only=True)
sur = cache.scorer.params["surrogate"]
rec = {}
orig = sur.predict
def predict(layer, x, heads, lengths):
    rec[layer] = (x, heads, lengths)
    return orig(layer, x, heads, lengths)
object.__setattr__(sur, "predict", predict) if False else None
sur.predict = predict
model(input_ids=docs[0][1], past_key_values=cache, use_cache=True)
print(docs[0][0], {k: v[2].tolist() for k, v in list(rec.items())[:1]})
for layer in sorted(rec):
    x, heads, lengths = rec[layer]
    means = []
    for L in (256, 512, 1024, 2048, 4096):
        p = orig(layer, x, heads, torch.tensor([L]))
        means.append(p.float().mean().item())
    slope = [(means[i+1]-means[i])/0.693 for i in range(4)]
    print(layer, " ".join(f"{m:7.3f}" for m in means), " slope/ln:", " ".join(f"{s:5.2f}" for s in slope))
