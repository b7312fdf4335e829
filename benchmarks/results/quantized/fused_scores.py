"""Issue 58, item 1, a probe: the attention scores of one decode step over 8-bit codes (per-token groups of 32
channels, bf16 scale and zero, as the quantized store keeps them), four ways, on one CPU thread, SmolLM2-shaped
(2 KV heads x 3 queries each, 4096 kept rows, head_dim 64). Prints microseconds per call; the results and what
they say are in fused_scores.md. Run alone on the machine:
`python benchmarks/results/quantized/fused_scores.py [LAYERS]` (default 24: cold caches, as a decode step reads
them; 1: one layer's keys, hot).
"""

import sys
import time

import torch

torch.set_num_threads(1)
H, N, D, G = 2, 4096, 64, 32  # kv heads x kept rows x head_dim; SmolLM2-ish layer
Q = 3  # queries per kv head (GQA)
k32 = torch.randn(H, N, D)
q = torch.randn(H, Q, D)
codes = torch.randint(0, 255, (H, N, D), dtype=torch.uint8)
scale = torch.rand(H, N, D // G, dtype=torch.bfloat16)
zero = torch.rand(H, N, D // G, dtype=torch.bfloat16)


def base(q, k):
    return q @ k.transpose(-1, -2)


def deq(q, codes, scale, zero):
    k = (codes.view(H, N, D // G, G).float() * scale.float()[..., None] + zero.float()[..., None]).view(
        H, N, D
    )
    return q @ k.transpose(-1, -2)


def algebra(q, codes, scale, zero):
    # q.k = sum_g s_g * (q_g . c_g) + z_g * sum(q_g)
    qg = q.view(H, Q, D // G, G)
    c = codes.view(H, N, D // G, G).float()
    dots = torch.einsum("hqgc,hngc->hqng", qg, c)
    return (dots * scale.float()[:, None] + qg.sum(-1)[:, :, None, :] * zero.float()[:, None]).sum(-1)


# a decode step reads every layer's keys once: cycle through 24 layers' worth (cold caches); 1: hot caches
LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 24


def bench(f, *a, n=48):
    copies = [[x.clone() if i else x for i, x in enumerate(a)] for _ in range(LAYERS)]  # q shared
    f(*a)
    t = time.perf_counter()
    for k in range(n):
        f(*copies[k % LAYERS])
    return (time.perf_counter() - t) / n * 1e6


print("fp32 keys", round(bench(base, q, k32)), "us")
print("dequant", round(bench(deq, q, codes, scale, zero)), "us")
print("algebra", round(bench(algebra, q, codes, scale, zero)), "us")
torch.testing.assert_close(deq(q, codes, scale, zero), algebra(q, codes, scale, zero), rtol=1e-4, atol=1e-2)
t = time.perf_counter()
cdeq = torch.compile(deq, dynamic=True)
cdeq(q, codes, scale, zero)
print("compile s", round(time.perf_counter() - t, 1))
print("compiled dequant", round(bench(cdeq, q, codes, scale, zero)), "us")


def fused(q, codes, scale, zero):
    k = (codes.view(H, N, D // G, G).float() * scale.float()[..., None] + zero.float()[..., None]).view(
        H, N, D
    )
    return (q[:, :, None, :] * k[:, None, :, :]).sum(-1)


cf = torch.compile(fused, dynamic=True)
t = time.perf_counter()
cf(q, codes, scale, zero)
print("compile s", round(time.perf_counter() - t, 1))
print("compiled fused-sum", round(bench(cf, q, codes, scale, zero)), "us")
torch.testing.assert_close(cf(q, codes, scale, zero), deq(q, codes, scale, zero), rtol=1e-4, atol=1e-2)
