"""One-off: which extra window-attention style features help the kvzap ridge (held-out python docs)."""

import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # benchmarks/
from kvzap_lengths import WINDOW, kept_share, mean_spearman, smollm2_with_targets  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from lukv_cache.attention.swap import attention_swapped  # noqa: E402
from lukv_cache.profiling import kvzap as pk  # noqa: E402
from lukv_cache.profiling.kvzap_options import KVzapTraining  # noqa: E402
from lukv_cache.scorers.builtin import _group_queries  # noqa: E402
from lukv_cache.scorers.kvzap import RidgeStats, rope_inverse  # noqa: E402

torch.set_num_threads(2)
torch.set_grad_enabled(False)
torch.manual_seed(0)
started = time.time()
model, tokenizer, targets = smollm2_with_targets()
H = model.config.num_key_value_heads


def wa(keys, q, scaling, per_qhead=False, use_max=False):
    b, h, t, d = keys.shape
    w = q.shape[2]
    g = q.shape[1] // h
    qq = _group_queries(q.float(), h)  # [b,h,g,w,d]
    logits = torch.einsum("bhgwd,bhtd->bhgwt", qq, keys.float()) * scaling
    sees = torch.arange(t)[None, :] <= torch.arange(t - w, t)[:, None]  # [w,t]
    logits = logits.masked_fill(~sees, float("-inf"))
    n = sees.sum(0).clamp_min(1).float()
    if use_max:
        return logits.amax(dim=(2, 3))[..., None]  # [b,h,t,1]
    if per_qhead:
        return (logits.logsumexp(3) - n.log()).permute(0, 1, 3, 2)  # [b,h,t,g]
    return (logits.flatten(2, 3).logsumexp(2) - (g * n).log())[..., None]


def feature_maps(ids):
    """{layer: (names->tensor [T, H, k])}"""
    out = {}
    impl = model.config._attn_implementation
    stock = ALL_ATTENTION_FUNCTIONS[impl]

    def observe(module, query, key, value, attention_mask, **kwargs):
        b, _, t, _ = key.shape
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(t).expand(b, t)
        s = getattr(module, "scaling", None) or key.shape[-1] ** -0.5
        kp = rope_inverse(module)(key, positions).float()
        base = torch.cat([kp, value.float()], -1)  # [b,h,t,2d]
        prev = torch.cat([torch.zeros_like(base[:, :, :1]), base[:, :, :-1]], 2)
        f = {
            "base": base,
            "wa32": wa(key, query[:, :, -32:], s),
            "wa8": wa(key, query[:, :, -8:], s),
            "wa128": wa(key, query[:, :, -128:], s),
            "wa32g": wa(key, query[:, :, -32:], s, per_qhead=True),
            "max32": wa(key, query[:, :, -32:], s, use_max=True),
            "prev": prev,
        }
        out[module.layer_idx] = {k: v[0].transpose(0, 1) for k, v in f.items()}  # [t,h,k]
        return stock(module, query, key, value, attention_mask, **kwargs)

    with attention_swapped(model, pk._FEATURES_IMPL, observe, mask=impl):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return out


ORDER = ["base", "wa32", "wa8", "wa128", "wa32g", "max32", "prev"]
VARIANTS = {
    "current (base+wa32)": ["base", "wa32"],
    "base+wa32 per query head": ["base", "wa32g"],
    "base+wa8+wa32+wa128": ["base", "wa8", "wa32", "wa128"],
    "base+wa32+max32": ["base", "wa32", "max32"],
    "base+wa32+prev token": ["base", "wa32", "prev"],
    "base+wa8/32/128+wa32g+max": ["base", "wa8", "wa32", "wa128", "wa32g", "max32"],
    "all": ORDER,
}


def full_x(f, tokens):
    """[T, 2F+1] with the column index per (block) recorded."""
    parts, index, col = [], {}, 0
    for name in ORDER:
        v = f[name].flatten(1)
        parts.append(v)
        index[name] = list(range(col, col + v.shape[1]))
        col += v.shape[1]
    x = torch.cat(parts, 1)
    lt = torch.full((x.shape[0], 1), float(tokens)).log()
    return torch.cat([x, lt, x * lt], 1), index, col


def cols(index, names, width):
    base = [c for n in names for c in index[n]]
    return base + [width] + [width + 1 + c for c in base]



NAMES = ["base", "wa32"]
def xcur(f, tokens):
    x = torch.cat([f[n].flatten(1) for n in NAMES], 1)
    lt = torch.full((x.shape[0], 1), float(tokens)).log()
    return torch.cat([x, lt, x * lt], 1)

def floor_q(y, q):
    return torch.maximum(y, torch.quantile(y, q, dim=0, keepdim=True))

TRANSFORMS = {
    "raw": lambda y: y,
    "floor q10": lambda y: floor_q(y, 0.1),
    "floor q30": lambda y: floor_q(y, 0.3),
    "floor q50": lambda y: floor_q(y, 0.5),
    "floor q70": lambda y: floor_q(y, 0.7),
    "floor -20": lambda y: y.clamp_min(-20),
    "floor -14": lambda y: y.clamp_min(-14),
}
training = KVzapTraining().corpus(tokenizer)
stats = {}
for i, ids in enumerate(training):
    maps = feature_maps(ids)
    t = ids.shape[1]
    for layer, y in targets(ids).items():
        x = xcur(maps[layer], t)[pk.SKIP_FIRST:]
        y = y[pk.SKIP_FIRST:]
        if i == 0 and layer in (0, 10, 29):
            print(layer, [round(float(v), 1) for v in torch.quantile(y[:, 0], torch.tensor([0, .1, .3, .5, .7, .9, 1.0]))])
        for name, tf in TRANSFORMS.items():
            stats.setdefault((name, layer), RidgeStats(x.shape[1], y.shape[1])).add(x, tf(y))
    print(i, f"{time.time() - started:.0f}s", flush=True)

solved = {}
for (name, layer), st in stats.items():
    for alpha in (1.0, 100.0):
        if alpha != 1.0 and name not in ("raw", "floor q30"):
            continue
        solved.setdefault(f"{name} a{alpha:g}", {})[layer] = st.solve(alpha)
print("solved", f"{time.time() - started:.0f}s", flush=True)

rows = {}
for tokens, docs in (
    (1024, pk.python_docs_documents(tokenizer, 8, 1024, seed=0)),
    (4096, pk.python_docs_documents(tokenizer, 2, 4096, seed=1)),
):
    for ids in docs:
        maps = feature_maps(ids)
        true = {layer: y[pk.SKIP_FIRST : tokens - WINDOW] for layer, y in targets(ids).items()}
        xf = {layer: xcur(maps[layer], tokens)[pk.SKIP_FIRST : tokens - WINDOW] for layer in true}
        for name, sol in solved.items():
            pred = {layer: ((xf[layer] - m) / s) @ w + b for layer, (w, b, m, s) in sol.items()}
            cell = rows.setdefault((name, tokens), {"rho": [], 0.8: [], 0.5: [], 0.9: []})
            cell["rho"].append(mean_spearman(pred, true))
            for r in (0.5, 0.8, 0.9):
                cell[r].append(kept_share(true, pred, r))
    print("tested", tokens, f"{time.time() - started:.0f}s", flush=True)

for (name, tokens), cell in rows.items():
    print(
        f"| {name} | {tokens} | {statistics.mean(cell['rho']):.3f} | {statistics.mean(cell[0.5]):.3f} "
        f"| {statistics.mean(cell[0.8]):.3f} | {statistics.mean(cell[0.9]):.3f} |"
    )
