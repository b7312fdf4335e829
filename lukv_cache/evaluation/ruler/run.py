"""Every method on every RULER sample: the context prefilled once per sample and shared by every method
(each compresses its own copy: :class:`~lukv_cache.evaluation.prefill.SharedPrefill`, the kvzip scores
computed once per scorer), then the question and answer prefix forwarded through the method's cache and the
answer decoded greedily (kvpress's protocol), scored and appended to the :class:`~.store.Store`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ...allocation import allocators_reading_profile
from ...cache import LUKVCache, kv_cache_bytes
from ...errors import ConfigurationError, ProfileError
from ...models import check_positions
from ...scorers import get_scorer
from ..decoding import greedy_decode
from ..methods import Method, make_cache, scorer_reads_profile
from ..prefill import SharedPrefill, shareable
from .generate import generate
from .prompt import Sample, from_row, prompt_ids
from .scoring import score
from .store import Store, read_samples, write_samples


@dataclass
class RulerSettings:
    """What ``lukv ruler`` runs: ``samples`` of each task at each length, with each method."""

    lengths: Sequence[int]
    tasks: Sequence[str]
    samples: int
    methods: Sequence[Method]
    seed: int = 42
    profiles_dir: str | None = None
    hub: bool = False
    share_prefill: bool = True


def load_samples(
    tokenizer: Any, task: str, length: int, settings: RulerSettings, folder: Path
) -> list[Sample]:
    """The task's samples at ``length``: read from ``folder`` when saved there, else generated and saved."""
    path = folder / f"seed{settings.seed}" / str(length) / f"{task}.jsonl"
    saved = read_samples(path, settings.samples)
    if saved is not None:
        return [Sample.from_json(row) for row in saved]
    samples = [
        from_row(task, row) for row in generate(task, tokenizer, length, settings.samples, settings.seed)
    ]
    write_samples(path, [s.to_json() for s in samples])
    return samples


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids generation stops at: the model's generation config's end tokens (kvpress's), else the
    tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]


def usable_methods(
    model: Any, settings: RulerSettings, say: Callable[[str], None]
) -> tuple[list[Method], dict[str, str]]:
    """The methods whose cache can be built; the others (no profile) with the reason, said once."""
    reads = allocators_reading_profile()
    skipped: dict[str, str] = {}
    for method in settings.methods:
        if not method.is_full and (method.allocator in reads or scorer_reads_profile(method.scorer)):
            try:
                make_cache(method, model, settings.profiles_dir, hub=settings.hub)
            except ProfileError as err:
                skipped[method.name] = str(err)
                say(f"skip {method.name}: {err}")
    return [m for m in settings.methods if m.name not in skipped], skipped


@torch.no_grad()
def _method_cache(
    method: Method,
    model: Any,
    tokenizer: Any,
    ids: torch.Tensor,
    shared: SharedPrefill | None,
    settings: RulerSettings,
) -> Any:
    if shared is not None:
        return shared.cache_with_scores(method, model, tokenizer, settings.profiles_dir, hub=settings.hub)
    cache = make_cache(method, model, settings.profiles_dir, hub=settings.hub)
    if isinstance(cache, LUKVCache):
        cache.prefill(model, ids, tokenizer=tokenizer, logits_to_keep=1)
    else:
        from ..._compat import cache_kwarg

        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    return cache


def run_ruler(
    model: Any,
    tokenizer: Any,
    settings: RulerSettings,
    store: Store,
    samples_folder: Path,
    *,
    log: Callable[[str], None] | None = print,
    progress: bool = True,
) -> dict[str, str]:
    """Run what ``store`` does not hold yet; returns the skipped methods and why. Every sample is built (and
    its length checked against the model's positions) before any method runs."""
    say = log or (lambda _msg: None)
    samples_of: dict[tuple[int, str], list[Sample]] = {}
    for length in settings.lengths:
        for task in settings.tasks:
            samples = load_samples(tokenizer, task, length, settings, samples_folder)
            for sample in samples:
                context, question = prompt_ids(tokenizer, sample)
                needed = len(context) + len(question) + sample.max_new_tokens
                check_positions(
                    model.config,
                    needed,
                    f"--lengths {length} ({task}, with the chat template)",
                    "pass a smaller --lengths",
                )
            samples_of[(length, task)] = samples
    methods, skipped = usable_methods(model, settings, say)
    share = settings.share_prefill and shareable(model)
    n_queries = max([get_scorer(str(m.scorer)).n_queries for m in methods if not m.is_full] + [2])
    stops = stop_ids(model, tokenizer)
    device = next(model.parameters()).device
    units = [(length, task, s, m) for (length, task), ss in samples_of.items() for s in ss for m in methods]
    done = sum((length, task, s.index, m.name) in store.done for length, task, s, m in units)
    bar = tqdm(total=len(units), initial=done, disable=not progress, unit="run", dynamic_ncols=True)
    for (length, task), samples in samples_of.items():
        for sample in samples:
            pending = [m for m in methods if (length, task, sample.index, m.name) not in store.done]
            if not pending:
                continue
            bar.set_description(f"{length} {task} #{sample.index}")
            context, question = prompt_ids(tokenizer, sample)
            ids = torch.tensor([context], dtype=torch.long, device=device)
            question_ids = torch.tensor([question], dtype=torch.long, device=device)
            shared = SharedPrefill.record(model, ids, n_queries) if share else None
            full_bytes = (
                sum(int(k.nbytes + v.nbytes) for k, v in zip(shared.keys, shared.values)) if shared else None
            )
            for method in pending:
                started = time.perf_counter()
                cache = _method_cache(method, model, tokenizer, ids, shared, settings)
                held = kv_cache_bytes(cache)
                new_ids = greedy_decode(model, cache, question_ids, sample.max_new_tokens, stops)[0]
                prediction = tokenizer.decode(new_ids, skip_special_tokens=True)
                store.append(
                    {
                        "length": length, "task": task, "index": sample.index, "method": method.name,
                        "score": score(task, prediction, sample.answer), "prediction": prediction,
                        "answer": sample.answer, "kv_bytes": int(held), "full_kv_bytes": full_bytes,
                        "context_tokens": len(context), "question_tokens": len(question),
                        "seconds": time.perf_counter() - started,
                        "prefill_seconds": shared.seconds if shared is not None else None,
                    }
                )  # fmt: skip
                bar.update(1)
    bar.close()
    if not methods:
        raise ConfigurationError("No method could run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return skipped
