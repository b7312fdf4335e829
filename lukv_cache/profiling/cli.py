"""``lukv build`` and ``lukv show``: build a profile from the shell, and look at one.

``lukv_cache.cli`` calls :func:`register` with its sub-parsers; commands return an exit code and let
:class:`~lukv_cache.errors.LUKVError` propagate (printed as one ``error:`` line, exit code 2).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from ..models import SMOLLM2_ALIAS, add_threads_argument
from .kvzap_options import CORPORA, FAMILIES, KVzapTraining


def _document_group(text: str) -> tuple[int, int]:
    """``"48x1024"`` -> ``(48, 1024)``; ``"48"`` -> ``(48, 1024)``."""
    count, x, tokens = text.lower().partition("x")
    try:
        group = (int(count), int(tokens) if x else 1024)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not COUNTxTOKENS (e.g. 48x1024) or a count") from None
    if min(group) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the count and the tokens must be positive")
    return group


def _groups(groups: tuple[tuple[int, int], ...]) -> str:
    return " ".join(f"{count}x{tokens}" for count, tokens in groups)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``build`` and ``show`` to the ``lukv`` command.

    >>> parser = argparse.ArgumentParser(prog="lukv")
    >>> register(parser.add_subparsers(dest="command"))
    >>> parser.parse_args(["build", "smollm2", "--scorer", "keydiff", "--scorer", "snapkv", "--out", "p/"]).scorer
    ['keydiff', 'snapkv']
    """
    build = subparsers.add_parser(
        "build",
        help="build LU-KV profiles of a model from a calibration set",
        description="Decode the calibration questions with a full cache, record the oracle importance, "
        "solve the allocation for every ratio and write one profile per scorer.",
    )
    build.add_argument(
        "model",
        metavar="MODEL_PATH_OR_ID",
        help=f"a local model folder or Hub id; '{SMOLLM2_ALIAS}' for the demo model",
    )
    build.add_argument("--scorer", action="append", help="scorer (repeat for several; default keydiff)")
    build.add_argument(
        "--out",
        type=Path,
        required=True,
        help="a .safetensors file (one scorer) or a folder (writes <folder>/<scorer>.safetensors)",
    )
    build.add_argument("--push", action="store_true", help="also publish to the shared profile repository")
    build.add_argument(
        "--repo-id", help="shared repository for --push (default: $LUKV_PROFILE_REPO or its default)"
    )
    build.add_argument(
        "--calibration", default="planted", help="shipped set name or JSONL file (default: planted)"
    )
    build.add_argument("--k-max", type=int, default=64, help="answer tokens decoded per question (64)")
    build.add_argument(
        "--aggregate",
        choices=("max", "mean"),
        default="max",
        help="oracle importance over the decode steps: max (the paper, default) or mean",
    )
    build.add_argument("--max-questions", type=int, help="use a seeded random subset of the questions")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--sink", type=int, default=4, help="protected first tokens (4)")
    build.add_argument("--window", type=int, help="protected last tokens (default: the scorer's own)")
    build.add_argument(
        "--kvzap-documents",
        nargs="+",
        type=_document_group,
        default=None,
        metavar="COUNTxTOKENS",
        help="--scorer kvzap: groups of training documents, e.g. 48x1024 8x4096 (a plain count means "
        f"documents of 1,024 tokens; default: {_groups(KVzapTraining().documents)})",
    )
    build.add_argument(
        "--kvzap-corpus",
        nargs="+",
        choices=CORPORA,
        default=None,
        help=f"--scorer kvzap: real text its documents come from, in turn (default: "
        f"{' '.join(KVzapTraining().corpora)})",
    )
    build.add_argument(
        "--kvzap-family",
        choices=FAMILIES,
        default=KVzapTraining().family,
        help="--scorer kvzap: the surrogate, a ridge regression or a 2-layer MLP (default: %(default)s)",
    )
    build.add_argument("--min-keep", type=float, default=0.01, help="fraction every head keeps (0.01)")
    build.add_argument(
        "--scope", choices=("all", "layer"), default="all", help="one budget for all layers, or per layer"
    )
    build.add_argument(
        "--cache-dir", help="per-question results, for resuming (default: ~/.cache/lukv_cache/profiling)"
    )
    build.add_argument(
        "--model-id", help="model id recorded in the profile (default: the model's name_or_path)"
    )
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_argument(build)
    build.set_defaults(func=_build)

    show = subparsers.add_parser("show", help="summarise a profile; optionally plot it")
    show.add_argument("profile", metavar="PROFILE", type=Path, help="a profile (.safetensors)")
    show.add_argument(
        "--ratio",
        type=float,
        nargs="+",
        action="extend",
        help="global ratio(s) to report, e.g. --ratio 0.5 0.8 (default 0.5 0.8 0.9)",
    )
    show.add_argument(
        "--png", type=Path, help="write heatmaps at the ratios (and curves, as <name>-curves.png)"
    )
    show.add_argument("--json", action="store_true", help="print the metadata as JSON")
    show.add_argument(
        "--model",
        metavar="MODEL_PATH_OR_ID",
        help="also decompose the eviction loss (LU-KV vs uniform, pyramid, AdaKV, global, hybrid) on a calibration set",
    )
    show.add_argument(
        "--calibration", default="default", help="calibration set for --model (default: default)"
    )
    show.add_argument("--max-questions", type=int, help="questions used by --model (default: all)")
    show.add_argument("--cache-dir", help="per-question results shared with `lukv build` (same default)")
    show.set_defaults(func=_show)


def _load_model(name: str):
    from ..models import load_model, weights_provenance

    model, tokenizer = load_model(name)
    return model, tokenizer, weights_provenance(name)


def _build(args: argparse.Namespace) -> int:
    from ..errors import ConfigurationError
    from ..scorers import get_scorer
    from . import build_profiles

    scorers = args.scorer or ["keydiff"]
    for name in scorers:  # unknown names fail before the model loads
        get_scorer(name)
    single_file = args.out.suffix == ".safetensors"
    if single_file and len(scorers) > 1:
        raise ConfigurationError("Several scorers need --out to be a folder (one <scorer>.safetensors each).")
    if not single_file and args.out.exists() and not args.out.is_dir():
        raise ConfigurationError(
            f"--out {str(args.out)!r} is a file; give a folder or a .safetensors file name."
        )
    if args.cache_dir and Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
        raise ConfigurationError(f"--cache-dir {args.cache_dir!r} is a file; give a folder.")
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
        kvzap=KVzapTraining(
            documents=tuple(args.kvzap_documents or KVzapTraining().documents),
            corpora=tuple(args.kvzap_corpus or KVzapTraining().corpora),
            family=args.kvzap_family,
        ),
    )
    for name, profile in profiles.items():
        path = profile.save(args.out if single_file else args.out / f"{name}.safetensors")
        print(f"wrote {path}")
        if args.push:
            sha = profile.push_to_hub(repo_id=args.repo_id)
            print(f"pushed {profile.model_id}/{name}.safetensors (commit {sha})")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(
        f"built {len(profiles)} profile(s) in {time.perf_counter() - start:.1f} s, peak RSS {peak_mib:.0f} MiB"
    )
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
