"""How a field of a policy is an option of the cache: its :class:`Option` (doc, check, how a saved
context writes it), declared with :func:`option` and read with :func:`option_spec`, and the call
signature the fields make (:func:`option_signature`).

:class:`~lukv_cache.cache.options.policy.CompressionPolicy` declares its fields with these; the cache's
signature and properties (:mod:`.surface`), the rendered docs (:mod:`.docs`) and the saved context's
options (:mod:`lukv_cache.cache.saved.options_json`) read them.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field, fields
from typing import Any

from .values import Check

EVERY_FILE: Any = object()  # Option.before of an option every saved file has


@dataclass(frozen=True)
class Option:
    """How a field of :class:`~lukv_cache.cache.options.policy.CompressionPolicy` is an option of the cache
    (the field's ``metadata``).

    ``doc``: one line (docs/usage.md's table, the cache's read-only property); ``more``: the rest of the
    cache docstring's entry. ``check``: ``(name, value as given, default) -> value as kept``, raising a
    ConfigurationError (``None``: kept as given, or resolved by
    :meth:`~lukv_cache.cache.options.policy.CompressionPolicy.build`).
    ``positional``: also taken by position (``LUKVCache(0.8, "keydiff", "uniform")``). ``saved``: written
    under a saved context's ``"options"`` as the kept value (``False``: saved by its own code, or not at all);
    ``kinds`` / ``low``: the JSON types and lower bound a saved value must have (``None``: ``check`` decides
    at load); ``before``: what a file written before the option existed meant (its key is missing: a new
    option's default, so that older files load; unset: every file has the key).
    """

    doc: str
    more: str = ""
    check: Check | None = None
    positional: bool = False
    saved: bool = True
    kinds: tuple[type, ...] | None = None
    low: float | None = None
    before: Any = EVERY_FILE  # with has_before

    @property
    def has_before(self) -> bool:
        """Whether a file may lack this option (it came after the format's first files)."""
        return self.before is not EVERY_FILE


def option(default: Any, doc: str, more: str = "", **spec: Any) -> Any:
    """A field of a policy that is an option of the cache: its ``default`` as given to the cache, and its
    :class:`Option` (``doc``, ``more``, and the rest of ``spec``)."""
    return field(default=default, metadata={"option": Option(doc, more, **spec)})


def option_spec(f: dataclasses.Field) -> Option:
    """The :class:`Option` of a policy's field (a field declared without :func:`option` only documents itself)."""
    return f.metadata.get("option") or Option(f.name)


def fields_of(policy_class: type) -> dict[str, dataclasses.Field]:
    """The fields of ``policy_class`` by name."""
    return {f.name: f for f in fields(policy_class)}


def option_signature(policy_class: type, *extra: inspect.Parameter) -> inspect.Signature:
    """The options of ``policy_class`` as a call signature, each with its default: the positional ones
    first, then the others keyword-only, then ``extra`` (a cache's own keyword-only arguments)."""
    params = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if option_spec(f).positional
            else inspect.Parameter.KEYWORD_ONLY,
            default=f.default,
        )
        for f in fields(policy_class)
    ]
    params.sort(key=lambda p: p.kind)  # stable: positional ones first, each group in field order
    return inspect.Signature([*params, *extra])
