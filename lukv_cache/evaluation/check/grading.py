"""Grading an answer against a reference answer: normalised, as whole words."""

from __future__ import annotations

import unicodedata


def normalise(text: str) -> str:
    """Lower case, accents and punctuation dropped, whitespace collapsed: ``"Nine o'clock."`` ->
    ``"nine o clock"``."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text).casefold())
    kept = "".join(c if c.isalnum() else " " for c in text if not unicodedata.combining(c))
    return " ".join(kept.split())


def is_correct(generated: str, answer: str) -> bool:
    """Whether ``generated`` answers ``answer``: some alternative of ``answer`` (split on ``|``),
    normalised (:func:`normalise`: case, accents, punctuation and spacing ignored), occurs in the
    normalised ``generated`` as whole words.

    >>> is_correct("The ferry leaves at nine o'clock.", "Nine")
    True
    >>> is_correct("It leaves at ninety.", "nine")
    False
    >>> is_correct("Ada Lovelace", "Ada|the harbour master")
    True
    """
    said = f" {normalise(generated)} "
    return any(f" {alt} " in said for alt in map(normalise, answer.split("|")) if alt)
