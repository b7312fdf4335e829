# Scratch script, as run but for its output folder, then hard-coded (issue 58 item 3):
#   SCRATCH=<scratch> python table_ab.py <checkout with layers_over_cells_prefill.patch applied> after before
# -> <scratch>/table_ab_after_before.json, committed here as table_ab.json. "before" replaces RecordedPrefill.for_model
# (the patch's) by a float32 recording of its own, as the code did before the patch.
"""The memory table's layers' losses from a float32 prefill of their own (before) and from the cells' bfloat16
prefill cast (after), one process, alone: seconds, layer losses, and the widths memory= picks at 1k."""
import os, sys, time, json
root = sys.argv[1]
sys.path.insert(0, root)
import numpy as np, torch
torch.set_num_threads(2)
from lukv_cache.models import load_model
from lukv_cache.profiles.profile import Profile
from lukv_cache.profiling.memory_table import measure_memory_table, calibration_texts, calibration_of
from lukv_cache.cache.compression.recorded import RecordedPrefill
model, tok = load_model("qwen2.5-coder-0.5b", threads=2)
path = root + "/profiles_hub/Qwen/Qwen2.5-Coder-0.5B-Instruct/keydiff.safetensors"
profile = Profile.load(path)
texts = calibration_texts(calibration_of(profile))
out = {}
ORIG = RecordedPrefill.for_model
for mode in sys.argv[2:]:
    RecordedPrefill.for_model = ORIG if mode == "after" else (lambda self, m: RecordedPrefill.record(m, self.input_ids, self.n_queries))
    t = time.perf_counter()
    table = measure_memory_table(model, tok, profile, texts, dtype="auto")
    secs = time.perf_counter() - t
    out[mode] = dict(seconds=secs, loss=table.loss.tolist(), layer_loss=table.layer_loss.tolist(), order=table.layer_order())
    print(mode, "%.1f s" % secs, "order", table.layer_order()[:8], flush=True)
    print(" layer_loss", np.round(table.layer_loss, 4).tolist(), flush=True)
    print(" cells", np.round(table.loss, 4).tolist(), flush=True)
json.dump(out, open(os.path.join(os.environ["SCRATCH"], "table_ab_%s.json" % "_".join(sys.argv[2:])), "w"))
