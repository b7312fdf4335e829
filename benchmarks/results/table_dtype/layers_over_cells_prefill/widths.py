# Scratch script, as run but for the checkout's folder, then hard-coded: python widths.py table_ab.json <checkout>; prints the
# layers memory= keeps at 8 bits on a 1,000-token prompt at 0.075 / 0.1 / 0.15 / 0.2 with each table.
import sys, json, dataclasses
ROOT = sys.argv[2]
sys.path.insert(0, ROOT)
import numpy as np, torch
torch.set_num_threads(2)
from lukv_cache.models import load_model
from lukv_cache.profiles.profile import Profile
from lukv_cache.profiles.memory_table import MemoryTable
from lukv_cache import LUKVCache
from lukv_cache.profiling.memory_table import calibration_texts
model, tok = load_model("qwen2.5-coder-0.5b", threads=2)
base = Profile.load(ROOT + "/profiles_hub/Qwen/Qwen2.5-Coder-0.5B-Instruct/keydiff.safetensors")
data = json.load(open(sys.argv[1]))
from lukv_cache.testing import prose
text = calibration_texts("default")[0] if False else None
import lukv_cache.testing as T
ids = tok(T.prose(3000, seed=11), return_tensors="pt").input_ids[:, :1000]
for name, d in data.items():
    from lukv_cache.profiling.memory_table import DEFAULT_RATIOS
    table = MemoryTable((None, 8, 4), np.asarray(DEFAULT_RATIOS, dtype=np.float32), np.asarray(d["loss"], dtype=np.float32), layer_loss=np.asarray(d["layer_loss"], dtype=np.float32))
    prof = dataclasses.replace(base, memory_table=table)
    rest = sorted(d["layer_loss"])[:-4]
    line = []
    for m in (0.075, 0.1, 0.15, 0.2):
        cache = LUKVCache.from_pretrained(prof, memory=m, config=model.config)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        bits = [getattr(l, "kv_bits", None) for l in cache.layers]
        line.append(sum(b == 8 for b in bits))
    print(name, "8-bit layers at 0.075/0.1/0.15/0.2:", line, "sum of all but the four largest %.4f" % sum(rest), "top", d["order"][:6])
