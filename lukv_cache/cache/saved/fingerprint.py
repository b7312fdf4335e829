"""A saved context's model identity: the fields of a model that decide a cache's shapes and their hash
(:func:`fingerprint_fields`), a sampled hash of its attention weights (:func:`weights_entry`), the check of
a model against both (:func:`check_model`), and what a model says of its layers' KV heads."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from ...errors import SavedContextMismatchError
from ..storage.state_check import dtype_name


def fingerprint_fields(config: Any, dtype: str) -> dict[str, Any]:
    """The fields of a model that decide a cache's shapes (layers, KV and query heads, head dim, layer
    types, sliding window, the KV dtype, the model type); their hash is the file's model fingerprint.

    >>> from transformers import LlamaConfig
    >>> fingerprint_fields(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4), "float32")["head_dim"]
    16
    """
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and heads:
        head_dim = getattr(text, "hidden_size", 0) // heads
    window = getattr(text, "sliding_window", None)
    return {
        "model_type": str(getattr(text, "model_type", "")),
        "num_hidden_layers": int(text.num_hidden_layers),
        "num_attention_heads": None if heads is None else int(heads),
        "num_key_value_heads": None if kv_heads is None else int(kv_heads),
        "head_dim": None if head_dim is None else int(head_dim),
        "layer_types": [str(kind) for kind in get_layer_types_and_kwargs(text)[0]],
        "sliding_window": None if window is None else int(window),
        "dtype": dtype,
    }


def fields_hash(value: Any) -> str:
    """sha256 of ``value`` as sorted JSON: the file's model fingerprint, of :func:`fingerprint_fields`."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


_WEIGHT_SAMPLES = 64  # elements read from each parameter, evenly spaced: cheap, and any dense change shows


def weights_entry(readers: Iterable[Any], model: Any) -> dict[str, Any] | None:
    """The file's weight fingerprint: which attention modules it covers (the first and the last layer's, by
    ``layer_idx`` and class name) and the hash of their weights (:func:`weights_hash`). The modules are the
    ones that read the cache (``readers``: weak references to them), else ``model``'s; ``None`` when neither has attention modules with a
    ``layer_idx`` (a model that attends in its own code)."""
    modules: dict[int, torch.nn.Module] = {}
    for ref in readers:
        module = ref()
        idx = getattr(module, "layer_idx", None)
        if isinstance(module, torch.nn.Module) and isinstance(idx, int):
            modules.setdefault(idx, module)
    if not modules:
        modules = attention_modules(model, None)
    if not modules:
        return None
    chosen = {i: modules[i] for i in sorted({min(modules), max(modules)})}
    return {"modules": {str(i): type(m).__name__ for i, m in chosen.items()}, "sha256": weights_hash(chosen)}


def attention_modules(model: Any, classes: dict[int, str] | None) -> dict[int, torch.nn.Module]:
    """``model``'s modules with an int ``layer_idx``, by it: those of the class ``classes`` names for
    that layer, or (``classes=None``) those whose class name ends in ``Attention`` (transformers' own)."""
    found: dict[int, torch.nn.Module] = {}
    if not isinstance(model, torch.nn.Module):
        return found
    for module in model.modules():
        idx, name = getattr(module, "layer_idx", None), type(module).__name__
        if not isinstance(idx, int) or idx in found:
            continue
        if (classes.get(idx) == name) if classes is not None else name.endswith("Attention"):
            found[idx] = module
    return found


def weights_hash(modules: dict[int, torch.nn.Module]) -> str:
    """sha256 over each module's parameters (name, dtype, shape, and ``_WEIGHT_SAMPLES`` evenly spaced
    elements): two checkpoints of one architecture differ in it, at a few small reads per parameter.
    Parameters not held here (on the meta device, offloaded; sharded tensor subclasses) count by name and
    shape only."""
    digest = hashlib.sha256()
    for i, module in sorted(modules.items()):
        digest.update(f"\0{i}\0{type(module).__name__}".encode())
        for name, p in sorted(module.named_parameters(), key=lambda item: item[0]):
            digest.update(f"\0{name}\0{dtype_name(p.dtype)}\0{list(p.shape)}\0".encode())
            if p.device.type == "meta" or type(p.data) is not torch.Tensor or not p.numel():
                continue
            flat = p.detach().reshape(-1)
            k = min(flat.numel(), _WEIGHT_SAMPLES)
            at = torch.arange(k, dtype=torch.int64) * (flat.numel() - 1) // max(k - 1, 1)
            sample = flat[at.to(flat.device)].cpu().contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def layer_kv_heads(model: Any, count: int, default: Any) -> list[Any]:
    """Each layer's KV heads: ``default`` (the config's ``num_key_value_heads``), unless the layer's attention
    module projects to another count (``k_proj.out_features // head_dim``: MiMo-V2-Flash's sliding layers
    have twice the global layers' KV heads)."""
    heads = [default] * count
    for idx, module in attention_modules(model, None).items():
        k_proj, head_dim = getattr(module, "k_proj", None), getattr(module, "head_dim", None)
        out = getattr(k_proj, "out_features", None)
        if 0 <= idx < count and isinstance(out, int) and isinstance(head_dim, int) and head_dim > 0:
            if out % head_dim == 0:
                heads[idx] = out // head_dim
    return heads


def check_model(meta: dict, model: Any, fail: Callable[..., NoReturn], allow_other_id: bool) -> None:
    """The saved ``meta``'s model against ``model``: its fingerprint fields, its id (unless ``allow_other_id``)
    and its weights; ``fail(why, field, cls=..., **fields)`` raises."""
    saved: Any = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    fields = saved.get("fields") if isinstance(saved.get("fields"), dict) else {}
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        fail(
            f"load_cache needs the transformers model the context was saved from, got {type(model).__name__}."
        )
    dtype = getattr(model, "dtype", None)
    got = fingerprint_fields(config, dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype))
    for key in got:
        if fields.get(key) != got[key]:
            fail(
                f"saved from a model with {key}={fields.get(key)!r}, this model has {key}={got[key]!r}: a saved "
                "context fits only the model (and dtype) it was saved from. Load the model it was saved from "
                f"(model id {saved.get('model_id')!r}), or compress the context again with this one.",
                key,
                SavedContextMismatchError,
                saved=fields.get(key),
                got=got[key],
            )
    if saved.get("fingerprint") != fields_hash(fields):
        fail(
            "its model fingerprint does not match its fields (damaged file). Save the context again.",
            "fingerprint",
        )
    model_id = str(getattr(config, "name_or_path", "") or "")
    if saved.get("model_id") != model_id and not allow_other_id:
        fail(
            f"saved from model {saved.get('model_id')!r}, this model is {model_id!r}. Load that model, or pass "
            "allow_other_model_id=True if it is the same model under another name (its shape matches).",
            "model_id",
            SavedContextMismatchError,
            saved=saved.get("model_id"),
            got=model_id,
        )
    _check_weights(saved.get("weights"), model, fail)


def _check_weights(weights: Any, model: Any, fail: Callable[..., NoReturn]) -> None:
    """The weight fingerprint, when the file has one (files written before it, or saved from a model that
    attends in its own code, are checked by shape and id only)."""
    if weights is None:
        return
    modules = weights.get("modules") if isinstance(weights, dict) else None
    if not (
        isinstance(modules, dict)
        and modules
        and all(isinstance(i, str) and i.isdigit() and isinstance(c, str) for i, c in modules.items())
    ):
        fail("its weight fingerprint is malformed (damaged file). Save the context again.", "weights")
    classes = {int(i): c for i, c in modules.items()}
    found = attention_modules(model, classes)
    got = weights_hash(found) if found.keys() == classes.keys() else None
    if got != weights.get("sha256"):
        layers = ", ".join(f"{c} of layer {i}" for i, c in sorted(classes.items()))
        fail(
            f"saved from a model with other weights (the sampled weights of {layers} differ, or this model "
            "lacks such modules): another checkpoint of the same architecture, e.g. another fine-tune. A saved "
            "context fits only the weights that computed it: load that checkpoint, or compress the context "
            "again with this model.",
            "weights",
            SavedContextMismatchError,
            saved=weights.get("sha256"),
            got=got,
        )
