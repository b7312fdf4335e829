# As run at 08509cb: python bf16_build.py <empty cache folder> <out>.safetensors (a bfloat16 copy's build, no table; what
# --oracle-dtype auto builds now: the same evict ratios, checked). Its table then: lukv memory-table qwen2.5-coder-0.5b <out> --out <final> --threads 1 (at 08509cb)
import sys, time, torch, numpy as np
t0 = time.perf_counter()
from lukv_cache.models import load_model
from lukv_cache.profiling.build import build_profiles
from lukv_cache.profiling.table_dtype import model_in
model, tok = load_model("qwen2.5-coder-0.5b", threads=2)
t1 = time.perf_counter()
with model_in(model, torch.bfloat16) as m:
    p = build_profiles(m, tok, ["keydiff"], memory_table=False, cache_dir=sys.argv[1], model_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", show_progress=True)["keydiff"]
t2 = time.perf_counter()
p.save(sys.argv[2])
print(f"load {t1-t0:.1f} build {t2-t1:.1f}")
