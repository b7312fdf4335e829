"""The gradient estimates of each layer's 4-bit loss against the passes that measure it (float32, the same 8
windows: table_kl/layer_est.py's per-window means, passes_fp32_means.npz), as in README.md.

    python compare.py passes_fp32_means.npz midpoint_fp32.npz
"""

import itertools
import sys

import numpy as np
from scipy.stats import spearmanr

passes, est = np.load(sys.argv[1]), np.load(sys.argv[2])
windows = [k.removesuffix("_first") for k in est if k.endswith("_first")]
nd = np.array([passes[f"{w}_nd"] for w in windows])  # [windows, layers]: NLL difference, the passes
kl = np.array([passes[f"{w}_kl"] for w in windows])
first = np.array([est[f"{w}_first"] for w in windows])
np.set_printoptions(precision=4, suppress=True, linewidth=200)
print("windows", windows)
print("passes (NLL difference), mean", nd.mean(0))
print("gradient estimate, mean       ", first.mean(0))
for name, e in [("estimate", first), ("estimate + KL", first + kl)]:
    rho = [spearmanr(nd[i], e[i])[0] for i in range(len(windows))]
    print(f"{name}: Spearman vs the passes per window {np.round(rho, 2)}, of the 8-window means {spearmanr(nd.mean(0), e.mean(0))[0]:.2f}")
print("8-window order, passes  ", np.argsort(-nd.mean(0))[:10])
print("8-window order, estimate", np.argsort(-first.mean(0))[:10])
for seed in sorted({w.split("_")[0] for w in windows}):
    rows = [i for i, w in enumerate(windows) if w.startswith(seed + "_")]
    print(f"{seed} (4 windows) order, passes  ", np.argsort(-nd[rows].mean(0))[:8])
    print(f"{seed} (4 windows) order, estimate", np.argsort(-first[rows].mean(0))[:8])
ref = set(np.argsort(-nd.mean(0))[:6])
for name, e in [("passes", nd), ("estimate", first)]:
    subsets = list(itertools.combinations(range(len(windows)), 4))
    tops = [set(np.argsort(-e[list(s)].mean(0))[:6]) for s in subsets]
    print(f"{name}: of {len(subsets)} draws of 4 windows, layer 14 in the top six {np.mean([14 in t for t in tops]):.2f}, "
          f"overlap with the passes' 8-window top six {np.mean([len(t & ref) for t in tops]):.2f}")
