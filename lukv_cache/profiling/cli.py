"""``lukv build``, ``lukv memory-table`` and ``lukv show``: build a profile from the shell, add its memory
table to one built without it, and look at one.

Their flags are declared in :mod:`lukv_cache.cli.profiling_commands` (argparse alone, so help needs no
torch); commands return an exit code and let :class:`~lukv_cache.errors.LUKVError` propagate (printed as
one ``error:`` line, exit code 2).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from .kvzap_options import KVzapTraining


def _load_model(name: str):
    from ..models import load_model, weights_provenance

    model, tokenizer = load_model(name)
    return model, tokenizer, weights_provenance(name)


def _build(args: argparse.Namespace) -> int:
    from ..errors import ConfigurationError
    from ..scorers import get_scorer

    scorers = args.scorer or ["keydiff"]
    for name in scorers:  # unknown names fail before the model loads
        get_scorer(name)
    if args.out is None:
        return _build_into(args, scorers, _default_profile_dir())
    single_file = args.out.suffix == ".safetensors"
    if single_file and len(scorers) > 1:
        raise ConfigurationError("Several scorers need --out to be a folder (one <scorer>.safetensors each).")
    if not single_file and args.out.exists() and not args.out.is_dir():
        raise ConfigurationError(
            f"--out {str(args.out)!r} is a file; give a folder or a .safetensors file name."
        )
    return _build_into(args, scorers, None)


def _default_profile_dir() -> Path:
    """Where ``lukv build`` without ``--out`` writes: the local profile folder ``from_pretrained`` searches
    first (``$LUKV_PROFILE_DIR``), else ``<lukv cache>/profiles`` (read once ``$LUKV_PROFILE_DIR`` names it).

    >>> _default_profile_dir().is_absolute() or "LUKV_PROFILE_DIR" in __import__("os").environ
    True
    """
    import os

    from .._paths import cache_root
    from ..profiles.location import LOCAL_DIR_ENV

    env = os.environ.get(LOCAL_DIR_ENV)
    return Path(env).expanduser() if env else cache_root() / "profiles"


def _build_into(args: argparse.Namespace, scorers: list[str], mirror: Path | None) -> int:
    """Build ``scorers``' profiles and write them to ``args.out``, or with ``mirror`` into that local
    profile folder (``<mirror>/<model id>/<scorer>.safetensors`` and its ``index.json``)."""
    import os

    from ..errors import ConfigurationError
    from ..profiles.location import LOCAL_DIR_ENV
    from . import build_profiles

    single_file = mirror is None and args.out.suffix == ".safetensors"
    if args.cache_dir and Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
        raise ConfigurationError(f"--cache-dir {args.cache_dir!r} is a file; give a folder.")
    kvzap = KVzapTraining(  # every --kvzap-* option and their combinations, before the model loads
        documents=tuple(args.kvzap_documents or KVzapTraining().documents),
        corpora=tuple(args.kvzap_corpus or KVzapTraining().corpora),
        family=args.kvzap_family,
        hidden=args.kvzap_hidden,
        length=args.kvzap_length,
        window_attention=args.kvzap_window_attention,
        target=args.kvzap_target,
    )
    if "kvzap" in scorers:
        _check_kvzap(kvzap, args)
    start = time.perf_counter()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer, extra = _load_model(args.model)
    profiles = build_profiles(
        model,
        tokenizer,
        scorers,
        args.calibration,
        k_max=args.k_max,
        aggregate=args.aggregate,
        sink=args.sink,
        window=args.window,
        min_keep=args.min_keep,
        scope=args.scope,
        max_questions=args.max_questions,
        seed=args.seed,
        cache_dir=args.cache_dir,
        show_progress=not args.quiet,
        model_id=args.model_id,
        extra=extra,
        kvzap=kvzap,
        memory_table=not args.no_memory_table,
        table_dtype=args.table_dtype,
        oracle_dtype=args.oracle_dtype,
        sliding=args.sliding,
    )
    for name, profile in profiles.items():
        if mirror is not None:
            from ..profiles.index import save_to_local_dir

            path = save_to_local_dir(profile, mirror)
        else:
            path = profile.save(args.out if single_file else args.out / f"{name}.safetensors")
        print(f"wrote {path}")
        if args.push:
            sha = profile.push_to_hub(repo_id=args.repo_id)
            print(f"pushed {profile.model_id}/{name}.safetensors (commit {sha})")
    if mirror is not None:  # say how from_pretrained finds it
        current = os.environ.get(LOCAL_DIR_ENV)
        if current and Path(current).expanduser() == mirror:
            print(f"LUKVCache.from_pretrained reads it from ${LOCAL_DIR_ENV} ({mirror})")
        else:
            print(
                f"LUKVCache.from_pretrained reads it with {LOCAL_DIR_ENV}={mirror} (or local_dir={str(mirror)!r})"
            )
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(
        f"built {len(profiles)} profile(s) in {time.perf_counter() - start:.1f} s, peak RSS {peak_mib:.0f} MiB"
    )
    return 0


def _check_kvzap(training: KVzapTraining, args: argparse.Namespace) -> None:
    """What a kvzap build needs of this model, from its config and tokenizer (not its weights): documents
    its positions do not cut below the minimum, memory for the surrogate, disk for the MLP's spilled rows,
    and a corpus holding the documents asked for."""
    import shutil

    from ..models import load_config, load_tokenizer, max_positions
    from .kvzap_training import targets_root

    config = load_config(args.model)
    free = None
    root = targets_root(args.cache_dir)
    if root is not None:
        existing = next((p for p in (root, *root.parents) if p.is_dir()), None)
        free = shutil.disk_usage(existing).free if existing is not None else None
    training.check_for(config, free_disk=free)
    training.corpus(load_tokenizer(args.model), args.seed, max_positions(config))


def _memory_table(args: argparse.Namespace) -> int:
    """``lukv memory-table MODEL PROFILE``: measure the profile's memory table and write it in."""
    from ..profiles.profile import Profile
    from .diagnostics import memory_table_lines
    from .memory_table import add_memory_table

    Profile.load(args.profile)  # a broken file fails before the model loads
    start = time.perf_counter()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer, _ = _load_model(args.model)
    path = add_memory_table(
        args.profile,
        model,
        tokenizer,
        args.calibration,
        out=args.out,
        replace=args.replace,
        contexts=args.contexts,
        layer_contexts=args.layer_contexts,
        continuation_tokens=args.continuation_tokens,
        context_tokens=args.context_tokens,
        seed=args.seed,
        show_progress=not args.quiet,
        share_prefill=not args.no_share_prefill,
        dtype=args.table_dtype,
    )
    print("\n".join(memory_table_lines(Profile.load(path).memory_table)))
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    return 0


def _show(args: argparse.Namespace) -> int:
    from ..profiles.profile import Profile
    from .diagnostics import plot_curves, plot_heatmap, profile_summary

    profile = Profile.load(args.profile)
    ratios = args.ratio or [0.5, 0.8, 0.9]
    if args.json:
        print(json.dumps(profile.summary(), indent=2, default=str))
    else:
        print(profile_summary(profile, ratios))
    if args.png:
        plot_heatmap(profile, ratios).savefig(args.png, dpi=120, bbox_inches="tight")
        curves = args.png.with_name(f"{args.png.stem}-curves{args.png.suffix}")
        plot_curves(profile).savefig(curves, dpi=120, bbox_inches="tight")
        print(f"wrote {args.png} and {curves}", file=sys.stderr)
    if args.model:
        from .diagnostics import loss_decomposition, plot_loss_decomposition

        model, tokenizer, _ = _load_model(args.model)
        for rho in ratios:
            decomposition = loss_decomposition(
                model,
                tokenizer,
                profile,
                args.calibration,
                ratio=rho,
                max_questions=args.max_questions,
                cache_dir=args.cache_dir,
            )
            print("\n" + decomposition.table())
            if args.png:
                loss_png = args.png.with_name(f"{args.png.stem}-loss-{rho:.2f}{args.png.suffix}")
                plot_loss_decomposition(decomposition).savefig(loss_png, dpi=120, bbox_inches="tight")
                print(f"wrote {loss_png}", file=sys.stderr)
    return 0
