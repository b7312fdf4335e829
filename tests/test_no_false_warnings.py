"""No false warnings (issue 43, item 4): the one line on a model it compresses, generating through every
keyword the installed transformers takes the cache by (``past_key_values`` on every supported release,
``cache`` from 5.24), compresses the prompt and emits no warning of lukv_cache's. transformers' own
FutureWarning for ``past_key_values`` on 5.24 is not ours. Each warning site's tests (that it fires when it
should, and not otherwise) live with its area's tests."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

import lukv_cache
from lukv_cache import LUKVCache
from lukv_cache.profiles import save_to_local_dir
from lukv_cache.testing import PROFILE_MODEL_ID, curve_profile, prompt, tiny_model

PACKAGE_DIR = os.path.dirname(os.path.abspath(lukv_cache.__file__))
PROMPT = 60


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings lukv_cache could have raised: every UserWarning and RuntimeWarning (the only categories
    it warns with, usually at the caller's stack level, so not attributed to its files) and anything
    attributed to a line inside it; not transformers' FutureWarning for past_key_values on 5.24."""
    return [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (UserWarning, RuntimeWarning)) or (w.filename or "").startswith(PACKAGE_DIR)
    ]


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_the_one_line_compresses_without_a_warning_of_its_own(keyword, tmp_path):
    model = tiny_model(name_or_path=PROFILE_MODEL_ID)
    if keyword == "cache" and "cache" not in inspect.signature(model.forward).parameters:
        pytest.skip("the forward takes the cache as past_key_values only before transformers 5.24")
    save_to_local_dir(curve_profile(2, 2), tmp_path)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        cache = LUKVCache.from_pretrained(model, ratio=0.5, local_dir=tmp_path, local_files_only=True)
        out = model.generate(prompt(1, PROMPT), **{keyword: cache}, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == PROMPT + 4
    assert int(cache.stored_tokens().max()) < PROMPT  # compressed
    assert _ours(caught) == []
