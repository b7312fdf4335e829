"""The options rendered as text from a policy's fields: docs/usage.md's table (:func:`options_table`)
and the cache docstring's Args entries (:func:`options_args`)."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import fields

from .policy import CompressionPolicy
from .spec import option_spec


def _default_text(f: dataclasses.Field) -> str:
    return repr(f.default)


def options_table(policy_class: type = CompressionPolicy) -> str:
    """docs/usage.md's table of the options: one markdown row per field of ``policy_class`` (its name, its
    default, its one-line doc).

    >>> print(options_table().splitlines()[7])
    | `sink` | `4` | First tokens of each row always kept (attention sinks). |
    """
    rows = ["| option | default | what it does |", "|---|---|---|"]
    rows += [f"| `{f.name}` | `{_default_text(f)}` | {option_spec(f).doc} |" for f in fields(policy_class)]
    return "\n".join(rows) + "\n"


def options_args(policy_class: type = CompressionPolicy, *, indent: int = 8, width: int = 110) -> str:
    """The options of ``policy_class`` as a docstring's Args entries (``name: doc more``; the signature shows the defaults),
    wrapped at ``width`` and indented by ``indent`` (continuation lines by four more)."""
    entries = []
    for f in fields(policy_class):
        spec = option_spec(f)
        text = " ".join(part for part in (spec.doc.replace("`", "``"), spec.more) if part)
        text = text.replace("````", "``")
        entries.append(
            textwrap.fill(
                f"{f.name}: {text}",
                width=width,
                initial_indent=" " * indent,
                subsequent_indent=" " * (indent + 4),
                break_on_hyphens=False,
            )
        )
    return "\n".join(entries) + "\n"
