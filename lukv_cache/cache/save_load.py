"""Saved compressed contexts: a filled :class:`~lukv_cache.LUKVCache` written to one safetensors file and
read back into the same model, so that a context compressed once (KVzip's repeat passes included) answers
later questions in any process without being recomputed.

* :func:`save_cache` writes every layer's ragged store, the used part of its dense suffix, the per-layer
  state the cache reads later (lengths, sinks still to protect, fold settings, recorded queries), the stock
  layers' keys and values, and the cache's options, with the model's id, a fingerprint of its shape and
  one of its attention weights (sampled);
* :func:`load_cache` checks the file (a safetensors file, complete, its checksum, this format version, the
  same model and weights, every layer having seen the same tokens, every tensor's shape and dtype against
  the metadata, every value but the scores finite) and rebuilds the cache as
  ``LUKVCache(..., config=model.config)`` does, then restores the layers.

``model.generate(continuation, past_key_values=load_cache(path, model))`` then continues exactly as the saved
cache would have. The file layout is described in docs/saved.md; :mod:`.saved.file` writes and reads it.

>>> path = save_cache(cache, "context.safetensors")  # doctest: +SKIP
>>> cache = load_cache(path, model)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SavedContextError
from .cache import LUKVCache
from .saved.file import (
    CHECKSUM_KEY,
    FORMAT_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_KEY,
    LoadOptions,
    checksum,
    read_context,
    write_context,
)
from .saved.fingerprint import fingerprint_fields

if TYPE_CHECKING:
    from ..scorers import Scorer


def save_cache(cache: LUKVCache, path: str | os.PathLike, *, model: Any = None) -> Path:
    """Write the filled compressed ``cache`` to ``path`` (one safetensors file) and return the path.

    ``model``: the model the cache was filled by; needed only when the cache cannot tell its config itself
    (a model that attends in its own code); by default the config of the attention modules that read the
    cache. The weight fingerprint is taken from those attention modules, else from ``model`` (pass it for a
    loaded cache that has not run yet). The file is written to a temporary file in the same folder and
    renamed: a reader sees the old file or the new one, and a failed write leaves nothing behind; a symlink
    is written through, a missing folder is refused. The file's mode is the one ``open()`` gives a new file
    (0o666 less the umask: 0644 under umask 022), also when it replaces one (whose mode is not kept).

    Refused with :class:`~lukv_cache.errors.SavedContextError`: a cache that holds nothing, one inside a
    forward (or a ``holding()`` block not yet evicted), one whose layers have seen different numbers of
    tokens (a forward interrupted part-way through the model: re-run the prompt), a tensor-parallel shard,
    layers the format does not store (linear-attention / SSM states of hybrid models), a tensor other than
    scores holding NaN or an infinity (it would be refused on load), and a path that cannot be written.
    """
    path = Path(path)
    if not isinstance(cache, LUKVCache):
        raise SavedContextError(
            f"save_cache saves a LUKVCache, got {type(cache).__name__}. For transformers' own caches, save "
            "their tensors yourself or recompute them.",
            path=str(path),
        )
    return write_context(cache, path, model)


def load_cache(
    path: str | os.PathLike,
    model: Any,
    *,
    device: Any = None,
    scorer: str | Scorer | None = None,
    allocator: Any = None,
    allow_other_model_id: bool = False,
) -> LUKVCache:
    """The :class:`~lukv_cache.LUKVCache` saved at ``path`` by :func:`save_cache`, ready for ``model``:
    ``model.generate(ids, past_key_values=load_cache(path, model))`` continues as the saved cache would.

    ``device``: where the tensors go (default: each decoder layer's device, else the model's).
    ``scorer`` / ``allocator``: instead of the saved ones (needed for a scorer or allocator that is not
    registered under its name in this process). ``allow_other_model_id``: accept a model whose id
    (``config.name_or_path``) differs while its fingerprint matches (the same model in another folder).

    Every problem raises :class:`~lukv_cache.errors.SavedContextError` (the file) or
    :class:`~lukv_cache.errors.SavedContextMismatchError` (another model, or the same shapes with other
    weights), naming what is wrong, a NaN or an infinity in any tensor but the scores included; a ``device``
    this process cannot use (``"meta"`` too: it holds no values) raises
    :class:`~lukv_cache.errors.ConfigurationError` naming those that work.
    """
    return read_context(LUKVCache, path, model, LoadOptions(device, scorer, allocator, allow_other_model_id))


__all__ = [
    "CHECKSUM_KEY",
    "FORMAT_KEY",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_KEY",
    "checksum",
    "fingerprint_fields",
    "load_cache",
    "save_cache",
]
