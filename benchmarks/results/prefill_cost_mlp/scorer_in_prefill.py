import time, torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # benchmarks/
from prefill_cost import text_ids
from lukv_cache import LUKVCache
from lukv_cache.models import load_model
from lukv_cache.scorers import kvzap as kz
model, tok = load_model("smollm2", threads=2)
ids = text_ids(tok, 4096)
acc = {"predict": 0.0, "scorer": 0.0}
orig_predict = kz.Surrogate.predict
def predict(self, *a, **k):
    t = time.perf_counter(); r = orig_predict(self, *a, **k); acc["predict"] += time.perf_counter() - t; return r
kz.Surrogate.predict = predict
orig = kz._kvzap
def wrapped(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); acc["scorer"] += time.perf_counter() - t; return r
kz._kvzap = wrapped
srcs = {"mlp": str(__import__("pathlib").Path(__file__).resolve().parents[3]) + "/profiles_hub/HuggingFaceTB/SmolLM2-135M-Instruct/kvzap.safetensors", "linear": str(__import__("pathlib").Path(__file__).resolve().parents[3]) + "/tests/data/kvzap_smollm2_linear_window.safetensors"}
with torch.no_grad():
    for r in range(2):
        for k, src in srcs.items():
            acc = {"predict": 0.0, "scorer": 0.0}
            cache = LUKVCache.from_pretrained(src, 0.8, "kvzap", local_files_only=True)
            t = time.perf_counter(); cache.prefill(model, ids, logits_to_keep=1); total = time.perf_counter() - t
            print(k, round(total, 2), {a: round(b, 3) for a, b in acc.items()}, flush=True)
