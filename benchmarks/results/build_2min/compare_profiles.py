"""Two keydiff profiles of Qwen2.5-Coder-0.5B side by side: their evict ratios and their memory tables.

    python compare_profiles.py A.safetensors B.safetensors
"""

import sys

import numpy as np
import safetensors.numpy

from lukv_cache.profiles import Profile

a, b = Profile.load(sys.argv[1]), Profile.load(sys.argv[2])
ta, tb = a.memory_table, b.memory_table
np.set_printoptions(precision=4, suppress=True, linewidth=200)
tensors_a, tensors_b = safetensors.numpy.load_file(sys.argv[1]), safetensors.numpy.load_file(sys.argv[2])
print("largest difference per tensor:", {k: float(np.abs(tensors_a[k] - tensors_b[k]).max()) for k in tensors_a})
print("cells A\n", ta.loss, "\ncells B\n", tb.loss)
print("cells: largest difference", float(np.abs(ta.loss - tb.loss).max()))
print("layers' losses: largest difference", float(np.abs(ta.layer_loss - tb.layer_loss).max()))
print("layers by loss at 4 bits A", np.argsort(-ta.layer_loss)[:9], "B", np.argsort(-tb.layer_loss)[:9])
print("measure A:", ta.measure)
print("measure B:", tb.measure)
