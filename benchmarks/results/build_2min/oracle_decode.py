"""The oracle's 24 calibration questions of a Qwen2.5-Coder-0.5B keydiff build, timed (issue 58, item 3).

Prefills the `planted` calibration context on a bfloat16 copy of the model (as a build's `--oracle-dtype auto`
does here), decodes the 24 questions as one batch, and prints the prefill's, the decode's and the batched
attention's (`_rows_attention`) seconds; saves the importances to compare two versions of the code:

    python oracle_decode.py THREADS OUT.npz 24

Run as it was for this record: at e71f157's oracle (`or_base`, 1 thread, beside a 1-thread benchmark),
ebe3904's (head-major attention, 1 thread, beside the same benchmark: importances bit-identical) and
5e42cbe's (answered questions leave the batch, 2 threads, alone: importances within 2.4e-7).
"""

import sys
import time

import numpy as np
import torch

from lukv_cache.models import load_model
from lukv_cache.profiling import oracle
from lukv_cache.profiling.build import prepare_run
from lukv_cache.profiling.table_dtype import model_in

torch.set_num_threads(int(sys.argv[1]))
model, tok = load_model("qwen2.5-coder-0.5b")
model.eval()
n = int(sys.argv[3])
with model_in(model, torch.bfloat16) as m:
    run = prepare_run(m, tok, "planted", cache_dir=False)
    t0 = time.perf_counter()
    run.prefill()
    t1 = time.perf_counter()
    total = [0.0]
    stock = oracle._rows_attention

    def timed(*args, **kwargs):
        started = time.perf_counter()
        out = stock(*args, **kwargs)
        total[0] += time.perf_counter() - started
        return out

    oracle._rows_attention = timed
    out = run.decode(list(range(n)))
    t2 = time.perf_counter()
print(f"prefill {t1 - t0:.2f} s decode {t2 - t1:.2f} s rows_attention {total[0]:.2f} s")
np.savez(sys.argv[2], *out)
