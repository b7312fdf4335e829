import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/ itself: helpers.py (the cached tiny models and the helpers only tests use) and sink_models.py are
# imported by name from every folder
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models are dominated by per-op overhead; one thread is faster and steadier on shared 2-core machines.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts on one torch thread and gives back what it found (a test may set its own)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _layouts_not_yet_warned(monkeypatch):
    """Every test starts in a process that has warned of no layout yet (a layout's warning is said once per
    process): a test that expects it does not depend on which tests ran before it."""
    from lukv_cache.cache.layers import layout

    monkeypatch.setattr(layout, "_warned", set())
