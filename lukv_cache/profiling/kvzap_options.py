"""How ``lukv build --scorer kvzap`` trains a surrogate: the options, without importing torch (the CLI
builds its help from them). The training itself is :mod:`lukv_cache.profiling.kvzap`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError

# the MLP surrogate's width wherever none is given (lukv build, train_surrogate): SmolLM2's shipped one;
# kvpress's KVzap MLPs are 512 wide (fit_mlp's default, which benchmarks/results/kvzap_surrogate/kvzap_training.py measured)
HIDDEN = 128

if TYPE_CHECKING:
    import torch

CORPORA = ("news", "python_docs")  # lukv_cache.profiling.kvzap_corpora.CORPORA reads them
FAMILIES = ("linear", "mlp")
TARGETS = ("kvzip_plus", "kvzip")  # the reconstruction scores a surrogate learns (their log)
LENGTH_INPUTS = ("none", "log", "interactions")  # lukv_cache.scorers.kvzap.FeatureSet.length
SKIP_FIRST = 4  # attention sinks: always kept, and their scores are outliers a surrogate need not learn
# the recent window kvzap protects (lukv_cache.scorers.kvzap.KVZAP_WINDOW; a test checks they agree): the
# score thresholds are read past the sinks and before it, so a document needs more than both
THRESHOLD_WINDOW = 32
MIN_TOKENS = SKIP_FIRST + THRESHOLD_WINDOW + 1
MAX_HIDDEN = 1 << 16  # the widest MLP a profile holds (lukv_cache.profiles.surrogate; a test checks)


@dataclass(frozen=True)
class KVzapTraining:
    """How a build trains a KVzap surrogate (``build_profile(..., kvzap=KVzapTraining(...))``, ``lukv build
    --scorer kvzap --kvzap-documents ... --kvzap-corpus ... --kvzap-family ...``).

    ``documents``: ``(count, tokens)`` groups of training documents, each group's documents taken in turn
    from ``corpora`` (:data:`CORPORA`: ``"news"``, gensim's news articles; ``"python_docs"``, Python's
    reference documentation). Long documents teach the surrogate long contexts, if it reads the length:
    trained on 1,024-token documents only, SmolLM2-135M's surrogate ranks 4,096-token contexts much worse
    than 1,024-token ones (Spearman 0.52 against 0.71); on 1k + 2k + 4k documents reading ``log T`` and
    every feature times it, 0.68 at 4k and still 0.71 at 1k (``benchmarks/results/kvzap_surrogate/kvzap_lengths.md``).
    ``family``: ``"mlp"`` (the default: ``hidden`` units, trained on ``samples`` rows per 1,024 tokens of
    each document, which wait on disk until their layer is fitted) or ``"linear"`` (ridge with strength
    ``alpha``, closed form; it ranks less well: ``docs/kvzap.md``). ``target``: the scores it learns, in log:
    ``"kvzip"`` (the default: KVzip's attention alone, the better scorer here) or ``"kvzip_plus"`` (KVzip+, as
    KVzap: attention divided by the repeat query's norm, times ``||v W_O||``). On SmolLM2-135M the KVzip
    target took the continuation loss at 0.8 from +0.048 to +0.042 at 1k and from +0.059 to +0.025 at 4k
    (``docs/kvzap.md``). ``length``: whether the surrogate also reads the context's length:
    ``"none"``, ``"log"`` (``log T``) or ``"interactions"`` (``log T`` and every feature times it), which lets
    each head's scores move with the length when the documents have several lengths. ``window_attention``:
    whether the surrogate also reads how strongly the last 32 queries of the context read each token (one
    number per KV head, with ``length="interactions"``): the context a token's key and value lack (held-out
    Python docs, ridge: Spearman 0.66 -> 0.73 at 1k and 0.59 -> 0.79 at 4k,
    ``benchmarks/results/kvzap_surrogate/kvzap_window_attention.md``).

    >>> KVzapTraining(documents=((48, 1024), (8, 4096))).describe()
    'news: 48 x 1,024 + 8 x 4,096 tokens'
    >>> KVzapTraining(family="tree")
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ConfigurationError: Unknown kvzap surrogate family 'tree'; use 'linear' or 'mlp'.
    """

    # group i draws its documents with seed + i, a group's first documents whatever its count: the default is
    # the first quarter of each group of the set benchmarks/results/kvzap_surrogate/kvzap_lengths.py measured
    # (48 x 1,024 + 8 x 4,096 + 8 x 2,048, the default before), chosen on the learning curve of
    # benchmarks/results/kvzap_documents/: as close to KVzip's selection at 1k and 4k for a quarter of its
    # repeat passes; the long documents cannot go (without them `global` at 4k keeps 3% of what KVzip keeps)
    documents: tuple[tuple[int, int], ...] = ((12, 1024), (2, 4096), (2, 2048))
    corpora: tuple[str, ...] = ("news",)
    family: str = "mlp"
    length: str = "interactions"
    window_attention: bool = True
    alpha: float = 1.0
    samples: int = 512
    hidden: int = HIDDEN
    target: str = "kvzip"

    def __post_init__(self) -> None:
        def count(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value > 0

        if self.family not in FAMILIES:
            raise ConfigurationError(
                f"Unknown kvzap surrogate family {self.family!r}; use 'linear' or 'mlp'."
            )
        if self.length not in LENGTH_INPUTS:
            raise ConfigurationError(
                f"kvzap length must be one of {list(LENGTH_INPUTS)}, got {self.length!r}."
            )
        if self.window_attention is not False and (
            self.window_attention is not True or self.length != "interactions"
        ):
            raise ConfigurationError(
                f"kvzap window_attention must be True or False, and True needs length='interactions'; got "
                f"{self.window_attention!r} with length {self.length!r}."
            )
        groups = self.documents
        if (
            not isinstance(groups, tuple)
            or not groups
            or not all(
                isinstance(g, tuple) and len(g) == 2 and count(g[0]) and count(g[1]) and g[1] >= MIN_TOKENS
                for g in groups
            )
        ):
            raise ConfigurationError(
                f"kvzap documents must be (count, tokens) pairs of positive integers, tokens at least "
                f"{MIN_TOKENS} (the {SKIP_FIRST} sinks and the {THRESHOLD_WINDOW}-token window are not "
                f"scored), e.g. ((48, 1024), (8, 4096)) (--kvzap-documents 48x1024 8x4096); got {groups!r}."
            )
        unknown = [c for c in self.corpora if c not in CORPORA]
        if not self.corpora or unknown or len(set(self.corpora)) != len(self.corpora):
            raise ConfigurationError(
                f"kvzap corpora must be distinct names among {sorted(CORPORA)}; got {list(self.corpora)!r}."
            )
        if self.target not in TARGETS:
            raise ConfigurationError(f"kvzap target must be one of {list(TARGETS)}, got {self.target!r}.")
        if not count(self.samples) or not count(self.hidden):
            raise ConfigurationError(
                f"kvzap samples and hidden must be positive integers; got {self.samples!r}, {self.hidden!r}."
            )
        if self.hidden > MAX_HIDDEN:
            raise ConfigurationError(
                f"kvzap hidden is the MLP's width and a profile holds at most {MAX_HIDDEN}; got {self.hidden}. "
                f"Pass a smaller --kvzap-hidden (default {HIDDEN}; kvpress uses 512)."
            )
        if not (isinstance(self.alpha, int | float) and not isinstance(self.alpha, bool) and self.alpha >= 0):
            raise ConfigurationError(f"kvzap alpha must be a number >= 0; got {self.alpha!r}.")

    def rows_per_layer(self, max_tokens: int | None = None) -> int:
        """The MLP's training rows per layer: ``samples`` random tokens per 1,024 of each document past its
        sinks, at least one per document (``max_tokens``: the model's positions, which cut documents)."""
        rows = 0
        for count, tokens in self.documents:
            scored = min(tokens, max_tokens or tokens) - SKIP_FIRST
            rows += count * max(1, self.samples * scored // 1024)
        return rows

    def footprint(self, config: Any) -> dict[str, int]:
        """Bytes a build of this surrogate needs for a model of ``config`` (an upper bound: every layer
        counted as full-attention): ``"surrogate"`` (its float32 weights, in memory and in the profile),
        ``"training"`` (the ridge's float64 statistics of every layer, or the MLP's rows of one layer and
        its training copy) and ``"disk"`` (the MLP's spilled rows of every layer, float32: ``layers x
        rows x (inputs + KV heads) x 4``; 0 for the ridge).

        >>> from transformers import LlamaConfig
        >>> smollm2 = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
        ...                       num_key_value_heads=3, max_position_embeddings=8192)
        >>> KVzapTraining().footprint(smollm2)["disk"] / 2**30  # 30 x 12,256 rows x 778 x 4 bytes
        1.065...
        """
        layers, heads, f = _shape(config, self.features)
        rows = self.rows_per_layer(_positions(config))
        if self.family == "linear":
            return {
                "surrogate": 4 * layers * (heads * f + heads + 2 * f),
                "training": 8 * layers * (f * f + f * heads + f + 2 * heads),
                "disk": 0,
            }
        m = self.hidden
        return {
            "surrogate": 4 * layers * (m * f + m + heads * m + heads + 2 * f),
            "training": 2 * 4 * rows * (f + heads),
            "disk": 4 * layers * rows * (f + heads),
        }

    def check_for(self, config: Any, free_disk: int | None = None, memory: int | None = None) -> None:
        """Refuse, before the model's weights load, a training this model cannot run: documents its positions
        cut below :data:`MIN_TOKENS`, a surrogate and its training data larger than ``memory`` (bytes;
        default the machine's), spilled rows larger than ``free_disk`` (bytes; ``None``: not checked).
        Raises :class:`ConfigurationError` saying which option to change."""
        limit = _positions(config)
        if limit is not None and limit < MIN_TOKENS:  # every document is cut to the model's positions
            raise ConfigurationError(
                f"The model has {limit} positions: kvzap's training documents need at least {MIN_TOKENS}."
            )
        need = self.footprint(config)
        memory = _physical_memory() if memory is None else memory
        if memory and need["surrogate"] + need["training"] > memory:
            raise ConfigurationError(
                f"A kvzap {self.family} surrogate of this shape needs about "
                f"{(need['surrogate'] + need['training']) / 2**30:.1f} GiB of memory to train (its weights "
                f"{need['surrogate'] / 2**30:.1f} GiB), more than this machine's {memory / 2**30:.1f} GiB. "
                "Pass a smaller --kvzap-hidden, or fewer or shorter --kvzap-documents."
            )
        if free_disk is not None and need["disk"] > free_disk:
            raise ConfigurationError(
                f"A kvzap MLP build spills {need['disk'] / 2**30:.1f} GiB of training rows to its cache folder, "
                f"which has {free_disk / 2**30:.1f} GiB free. Free some space, pass another --cache-dir, or "
                "pass fewer or shorter --kvzap-documents."
            )

    def corpus(self, tokenizer: Any, seed: int = 0, max_tokens: int | None = None) -> list[torch.Tensor]:
        """The training documents ``[1, tokens]`` (each cut to ``max_tokens``, the model's positions)."""
        from . import kvzap_corpora

        docs = []
        for group, (count, tokens) in enumerate(self.documents):
            tokens = min(tokens, max_tokens or tokens)
            n = len(self.corpora)
            for i, name in enumerate(self.corpora):
                share = count // n + (i < count % n)
                if share:
                    docs += kvzap_corpora.CORPORA[name](tokenizer, share, tokens, seed=seed + group)
        return docs

    @property
    def features(self) -> str:
        """The name of the surrogate's feature set (:class:`lukv_cache.scorers.kvzap.FeatureSet`): the window
        attention reads the length with its interactions."""
        from ..scorers.kvzap import WINDOW_FEATURES, FeatureSet

        return WINDOW_FEATURES if self.window_attention else FeatureSet(length=self.length).name

    def describe(self) -> str:
        groups = " + ".join(f"{count} x {tokens:,}" for count, tokens in self.documents)
        return f"{', '.join(self.corpora)}: {groups} tokens"


def _positions(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _shape(config: Any, feature_set: str) -> tuple[int, int, int]:
    """(layers, KV heads, a surrogate's inputs) for a model of ``config`` and ``feature_set``."""
    from ..scorers.kvzap import FeatureSet

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return int(text.num_hidden_layers), int(heads), FeatureSet.named(feature_set).inputs(heads, head_dim)


def _physical_memory() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
