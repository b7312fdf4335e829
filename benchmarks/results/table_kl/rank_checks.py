# As run (two inline snippets, joined here): SCRATCH=<scratch> python rank_checks.py split > split_half.txt;
# SCRATCH=<scratch> python rank_checks.py rank14 > rank14.txt. Reads layer_est.py's <scratch>/layer_est.npz.
import itertools, os, sys
import numpy as np
d = dict(np.load(os.environ["SCRATCH"] + "/layer_est.npz"))
W = [(s, w) for s in (0, 1) for w in range(4)]
def vec(dt, k, s, w=4, T=128):
    return np.mean([d[f"{dt}_s{s}_w{i}_{k}"][:, :T].mean(1) for i in range(w)], axis=0)
def sp(a, b):
    return np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1]
if sys.argv[1] == "split":
    for dt in ("float32", "bfloat16"):
        for k in ("nd", "kl"):
            for w, T in ((4, 128), (2, 64), (2, 32)):
                a, b = vec(dt, k, 0, w, T), vec(dt, k, 1, w, T)
                print(dt, k, f"w{w} T{T}", "spearman seed0 vs seed1 %+.2f" % sp(a, b), "negatives", int((a < 0).sum()), int((b < 0).sum()))
else:
    for dt in ("float32", "bfloat16"):
        for k in ("nd", "kl"):
            for n in (2, 4, 8):
                ranks = []
                for sub in itertools.combinations(W, n):
                    v = np.mean([d[f"{dt}_s{s}_w{w}_{k}"].mean(1) for s, w in sub], axis=0)
                    ranks.append(int(np.where(np.argsort(-v) == 14)[0][0]))
                ranks = np.array(ranks)
                print(dt, k, n, "windows: layer 14 in the top six in %.2f of %d choices of windows, median rank (0 = first) %d" % ((ranks < 6).mean(), len(ranks), np.median(ranks)))
    for dt in ("float32", "bfloat16"):
        for k in ("nd", "kl"):
            v = [d[f"{dt}_s{s}_w{w}_{k}"][14].mean() for s, w in W]
            print(dt, k, "layer 14 per window", np.round(v, 4).tolist())
