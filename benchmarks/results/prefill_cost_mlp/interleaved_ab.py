import time, torch, sys
sys.path.insert(0, "benchmarks")
from prefill_cost import text_ids
from lukv_cache import LUKVCache
from lukv_cache.models import load_model
model, tok = load_model("smollm2", threads=2)
ids = text_ids(tok, 4096)
srcs = {"mlp": "profiles_hub/HuggingFaceTB/SmolLM2-135M-Instruct/kvzap.safetensors", "linear": "tests/data/kvzap_smollm2_linear_window.safetensors", "keydiff": None}
times = {k: [] for k in srcs}
with torch.no_grad():
    for r in range(4):
        for k, src in srcs.items():
            cache = LUKVCache(0.8, "keydiff", "uniform") if src is None else LUKVCache.from_pretrained(src, 0.8, "kvzap", local_files_only=True)
            t = time.perf_counter(); cache.prefill(model, ids, logits_to_keep=1); times[k].append(round(time.perf_counter() - t, 2))
print(times)
