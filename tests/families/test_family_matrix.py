"""The model-family matrix (issue 30): every decoder-only text family of the installed transformers, one
test each, all in this one process (a family's failure must not change the next family's result).

Each test builds the family's tiny model and runs the case of ``families.run_family``; the outcome must be
``families.expected(model_type)`` (``works`` for a family this table does not know yet; rows that
transformers 5.24 and 5.25 changed are in ``SINCE_5_24`` / ``SINCE_5_25``), and a typed error or warning must contain
``families.expected_message(model_type)``. Families that crash or are silently wrong today
expect their fixed outcome and are ``xfail(strict=True)``: a fix makes them XPASS, which fails the run
until ``XFAIL`` (and ``EXPECTED``) in families.py are updated. Select or exclude with ``-m families``.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import families  # noqa: E402

pytestmark = pytest.mark.families


def _params():
    params = []
    for model_type in families.matrix_families():
        marks = []
        if model_type in families.XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=families.XFAIL[model_type]))
        params.append(pytest.param(model_type, marks=marks, id=model_type))
    return params


@pytest.fixture(autouse=True)
def _one_thread_quiet():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # transformers' config chatter (token ids, rope) on every tiny config
    yield
    logging.disable(previous)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", _params())
def test_family(model_type):
    result = families.run_family(model_type)
    want = families.expected(model_type)
    summary = f"{result.outcome}: {result.detail} {result.error_type} {result.frame}".strip()
    assert result.outcome == want, f"{model_type}: expected {want}, got {summary}"
    message = families.expected_message(model_type)
    if message is not None:
        assert message in result.detail, f"{model_type}: expected a message with {message!r}, got {summary}"


def test_expectations_are_acceptable():
    """raw_crash and silently_wrong are never expected: such families expect their fix and are xfail."""
    bad = {t: o for t, o in families.EXPECTED.items() if o in ("raw_crash", "silently_wrong")}
    assert not bad, bad
    assert set(families.EXPECTED.values()) <= set(families.OUTCOMES)
    assert set(families.XFAIL) <= set(families.EXPECTED)
    assert set(families.EXPECTED_MESSAGE) <= set(families.EXPECTED)
    since = {outcome for _, rows in families.SINCE for outcome, _ in rows.values()}
    assert since <= set(families.OUTCOMES) - {"raw_crash", "silently_wrong"}
    releases = [release for release, _ in families.SINCE]
    assert releases == sorted(releases, key=lambda r: tuple(map(int, r.split("."))))


@pytest.mark.parametrize(
    "version, falcon, xlstm",
    [
        ("5.23.0", "typed_error", "refused_by_transformers"),
        ("5.24.0", "typed_error", "typed_error"),
        ("5.25.0", "works", "typed_error"),
        ("5.26.0", "works", "typed_error"),
    ],
)
def test_each_release_expects_its_own_rows(version, falcon, xlstm):
    """The latest release up to ``version`` that changed a row decides it; the messages follow the rows."""
    assert families.expected("falcon", version) == falcon
    assert families.expected_message("falcon", version) == (
        None if falcon == "works" else "computes attention in its own code"
    )
    assert families.expected("xlstm", version) == xlstm
    since_5_24 = version != "5.23.0"
    assert (families.expected_message("xlstm", version) is not None) == since_5_24
    assert families.expected("codegen", version) == ("works" if since_5_24 else "typed_error")
    assert families.expected("llama", version) == "works"


def test_a_tiny_config_over_the_size_bound_is_not_built(monkeypatch):
    """MAX_PARAMS names a missed shrink (a count on the meta device, not a build time)."""
    monkeypatch.setattr(families, "MAX_PARAMS", 1_000)
    result = families.run_family("llama")
    assert result.outcome == "not_built", result
    assert "parameters (> 1,000): a size field is not shrunk" in result.detail


def test_an_alibi_falcon_is_a_typed_error(monkeypatch):
    """The matrix's Falcon is the defaults' rotary one (it works from 5.25); an ALiBi Falcon (falcon-rw) adds
    its bias to the attention mask, one per head, which the compressed store cannot read: a typed error at
    ratio 0.5 on every release (5.23/5.24: its attention is its own code), after ratio 0 ran exactly (nothing
    compressed: DynamicCache's logits; 5.25 refused ratio 0 too before issue 54)."""
    import transformers
    from packaging.version import Version

    monkeypatch.setitem(families.OVERRIDES, "falcon", {"alibi": True})
    result = families.run_family("falcon")
    assert result.outcome == "typed_error", result
    assert result.detail.startswith(f"ratio {families.RATIO}:"), result.detail  # ratio 0 passed
    since_5_25 = Version(transformers.__version__) >= Version("5.25")
    want = "mask of its own per head" if since_5_25 else "computes attention in its own code"
    assert want in result.detail, result.detail
