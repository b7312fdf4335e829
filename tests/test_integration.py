"""lukv_cache.integration: what it changes in the process (transformers' attention and mask registries,
the import hook, the handoff's slot) is undone exactly by ``uninstall()``, and ``install()`` makes the same
changes again, once however often it is called."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import greedy_with_logits, tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from lukv_cache import LUKVCache, integration
from lukv_cache.attention import is_lukv_aware
from lukv_cache.attention.calls import any_pending
from lukv_cache.errors import IncompatibleAttentionError
from lukv_cache.testing import prompt

ROOT = Path(__file__).resolve().parents[1]
ADDED = ("eager", "lukv")  # the names lukv adds to AttentionInterface (transformers 5.23-5.25 have neither)


def _registries() -> tuple[dict, dict]:
    return dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)


@pytest.fixture
def installed_after():
    """The test may uninstall: the process is given back installed, as the other tests expect it."""
    yield
    integration.install()


def test_uninstall_restores_the_registries_and_install_makes_the_same_changes_again(installed_after):
    assert integration.is_installed()
    attention, masks = _registries()
    assert attention["sdpa"].__name__ == "lukv_sdpa_attention_forward"
    assert all(is_lukv_aware(fn) for fn in attention.values())  # routed or guarded, every one

    integration.uninstall()
    assert not integration.is_installed()
    # what transformers had: the stock sdpa, each guarded function unwrapped, no name of lukv's
    stock = {
        name: getattr(fn, "__wrapped__", fn) for name, fn in attention.items() if name not in (*ADDED, "sdpa")
    }
    assert _registries() == (
        {**stock, "sdpa": sdpa_attention_forward},
        {k: v for k, v in masks.items() if k != "lukv"},
    )
    # none of install()'s functions is left (an observer an earlier test registered with attention_swapped,
    # lukv-aware too, stays: it is not install()'s)
    ours = [fn for name, fn in attention.items() if name in (*ADDED, "sdpa") or hasattr(fn, "__wrapped__")]
    assert not any(fn in ours for fn in AttentionInterface._global_mapping.values())
    integration.uninstall()  # twice: nothing more to undo
    assert _registries()[0] == {**stock, "sdpa": sdpa_attention_forward}

    integration.install()
    again = _registries()
    assert again[1] == masks and again[0].keys() == attention.keys()
    for name, fn in attention.items():
        if fn not in ours or name in ADDED or name == "sdpa":
            assert again[0][name] is fn  # the same routing wrappers (or an observer, untouched)
        else:  # a new guard around the same stock function
            assert again[0][name].__name__ == fn.__name__ and again[0][name].__wrapped__ is fn.__wrapped__
    integration.install()  # idempotent
    integration.guard_attention()  # nothing left to guard
    assert _registries() == again


def test_an_entry_registered_over_lukvs_stays_when_lukv_uninstalls(installed_after):
    def theirs(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def later(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    mapping = AttentionInterface._global_mapping
    AttentionInterface.register("test_theirs", theirs)
    AttentionInterface.register("test_later", later)
    try:
        integration.guard_attention()
        assert mapping["test_theirs"].__wrapped__ is theirs and mapping["test_later"].__wrapped__ is later
        AttentionInterface.register("test_theirs", later)  # over lukv's guard: not lukv's to take back
        integration.uninstall()
        assert mapping["test_theirs"] is later and mapping["test_later"] is later
    finally:
        del mapping["test_theirs"], mapping["test_later"]


def test_a_lukv_cache_forward_after_uninstall_raises_until_install(installed_after):
    model, ids = tiny_model("llama"), prompt(1, 12)
    expected, _ = greedy_with_logits(model, ids, LUKVCache(0.5))
    integration.uninstall()
    with pytest.raises(IncompatibleAttentionError, match=r"uninstalled.*integration\.install\(\)"):
        greedy_with_logits(model, ids, LUKVCache(0.5))
    assert not any_pending()
    integration.install()
    seqs, _ = greedy_with_logits(model, ids, LUKVCache(0.5))
    assert torch.equal(seqs, expected)


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (the repository first on its path); it prints one JSON line last."""
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


_SNAPSHOT = """
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
def snapshot():
    return dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)
def same(a, b):  # the same names, each to the very same function
    return all(x.keys() == y.keys() and all(x[k] is y[k] for k in x) for x, y in zip(a, b))
"""


def test_transformers_registries_are_exactly_as_before_lukv_after_uninstall():
    code = f"""
import json
import transformers.modeling_utils
{_SNAPSHOT}
before = snapshot()
import lukv_cache
from lukv_cache import integration
installed = snapshot()
integration.uninstall()
undone = snapshot()
integration.install()
again = snapshot()
integration.uninstall()
print(json.dumps({{
    "changed": not same(before, installed),
    "undone": same(before, undone),
    "names_again": [sorted(a) for a in again] == [sorted(a) for a in installed],
    "undone_twice": same(before, snapshot()),
}}))
"""
    assert _fresh(code) == {"changed": True, "undone": True, "names_again": True, "undone_twice": True}


def test_uninstall_before_transformers_is_imported_removes_the_hook():
    code = f"""
import json, sys
import lukv_cache
from lukv_cache import integration
waiting = integration.hook_waiting()
integration.uninstall()
light = "torch" not in sys.modules and "transformers" not in sys.modules
{_SNAPSHOT}
untouched = snapshot()
stock = "lukv" not in untouched[0] and "lukv" not in untouched[1] and not integration.is_installed()
integration.install()
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
print(json.dumps({{
    "waiting": waiting,
    "removed": not integration.hook_waiting(),
    "light": light,
    "stock": stock,
    "installed": ALL_ATTENTION_FUNCTIONS["lukv"].__name__,
}}))
"""
    assert _fresh(code) == {
        "waiting": True,
        "removed": True,
        "light": True,
        "stock": True,
        "installed": "lukv_sdpa_attention_forward",
    }
