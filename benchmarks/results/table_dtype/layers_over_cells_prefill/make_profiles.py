# Scratch snippet, as run but for its folder, then hard-coded (SCRATCH=<scratch> python - in the checkout): the shipped Qwen2.5-Coder-0.5B keydiff profile (it holds no table)
# with each table of table_ab.json (then at <scratch>/table_ab_after_before.json), into the folders the two
# `lukv bench --profiles` runs read.
import json, dataclasses, numpy as np, os
from lukv_cache.profiles.profile import Profile
from lukv_cache.profiles.memory_table import MemoryTable
from lukv_cache.profiling.memory_table import DEFAULT_RATIOS
base = Profile.load("profiles_hub/Qwen/Qwen2.5-Coder-0.5B-Instruct/keydiff.safetensors")
print("shipped table:", base.memory_table.measure if base.memory_table else None)
d = json.load(open(os.environ["SCRATCH"] + "/table_ab_after_before.json"))
for name, how in (("after", "layers' losses: float32 over the cells' bfloat16 prefill"), ("before", "layers' losses: float32, own prefill")):
    t = MemoryTable((None, 8, 4), np.asarray(DEFAULT_RATIOS, dtype=np.float32), np.asarray(d[name]["loss"], dtype=np.float32),
                    measure=f"continuation excess NLL, 4 contexts, seed 0, bfloat16 passes ({how})",
                    layer_loss=np.asarray(d[name]["layer_loss"], dtype=np.float32))
    folder = os.environ["SCRATCH"] + f"/prof_{name}/Qwen/Qwen2.5-Coder-0.5B-Instruct"
    os.makedirs(folder, exist_ok=True)
    dataclasses.replace(base, memory_table=t).save(folder + "/keydiff.safetensors")
print("ok")
