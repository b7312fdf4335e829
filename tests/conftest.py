import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/ itself: factories.py (the tiny test profiles) is imported as ``factories`` from every folder
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

# Tiny models are dominated by per-op overhead; one thread is faster and steadier on shared 2-core machines.
torch.set_num_threads(1)
