"""``lukv pull | push | list | convert``: profiles from the shell.

``lukv_cache.cli`` calls :func:`register` with its sub-parsers; each command returns an exit code and
lets :class:`~lukv_cache.errors.LUKVError` propagate (printed as one ``error:`` line, exit code 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .location import DEFAULT_SCORER, HubLocation
from .profile import Profile


def _hub_options(parser: argparse.ArgumentParser, *, revision_help: str) -> None:
    parser.add_argument(
        "--repo-id", help="shared profile repository (default: $LUKV_PROFILE_REPO or lukv-cache/profiles)"
    )
    parser.add_argument("--revision", help=revision_help)
    parser.add_argument("--endpoint", help="Hub endpoint (default: huggingface_hub's, i.e. $HF_ENDPOINT)")
    parser.add_argument("--token", help="Hub token (default: huggingface_hub's stored token / $HF_TOKEN)")


def _hub(args: argparse.Namespace) -> HubLocation:
    return HubLocation(
        repo_id=args.repo_id,
        revision=args.revision,
        token=args.token,
        cache_dir=getattr(args, "cache_dir", None),
        endpoint=args.endpoint,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pull``, ``push``, ``list`` and ``convert`` to the ``lukv`` command.

    >>> parser = argparse.ArgumentParser(prog="lukv")
    >>> register(parser.add_subparsers(dest="command"))
    >>> parser.parse_args(["pull", "org/model"]).scorer
    'keydiff'
    """
    pull = subparsers.add_parser("pull", help="download the shared profile of a model (into the Hub cache)")
    pull.add_argument("model_id", metavar="MODEL_ID", help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    pull.add_argument(
        "--scorer", default=DEFAULT_SCORER, help=f"scorer the profile was built for ({DEFAULT_SCORER})"
    )
    _hub_options(pull, revision_help="branch, tag or commit sha of the shared repository (default: main)")
    pull.add_argument("--out", type=Path, help="also write a copy of the profile to this file")
    pull.add_argument("--cache-dir", help="huggingface_hub cache folder (default: its usual one)")
    pull.add_argument("--local-dir", help="folder of profiles searched first (default: $LUKV_PROFILE_DIR)")
    pull.set_defaults(func=_pull)

    push = subparsers.add_parser("push", help="publish a profile file to the shared repository")
    push.add_argument("file", metavar="FILE", type=Path, help="a profile (.safetensors)")
    push.add_argument("--model-id", help="publish under this model id (default: the one in the file)")
    _hub_options(push, revision_help="branch to commit to (default: main)")
    push.add_argument(
        "--local-dir",
        help="write into this local mirror (e.g. profiles_hub/) and its index instead of the Hub",
    )
    push.set_defaults(func=_push)

    listing = subparsers.add_parser("list", help="list the profiles in the shared repository")
    listing.add_argument("--model-id", help="only this model's profiles")
    _hub_options(listing, revision_help="branch, tag or commit sha (default: main)")
    listing.add_argument("--local-dir", help="list a local mirror (e.g. profiles_hub/) instead of the Hub")
    listing.add_argument("--cache-dir", help="huggingface_hub cache folder (default: its usual one)")
    listing.add_argument("--json", action="store_true", help="print the index entries as JSON")
    listing.set_defaults(func=_list)

    convert = subparsers.add_parser(
        "convert", help="turn a LU-KV / kvpress curve (.npy [99, L, H_kv]) into a profile"
    )
    convert.add_argument("curve", metavar="CURVE.npy", type=Path)
    convert.add_argument(
        "--model", required=True, metavar="MODEL_ID", help="the model id the curve was built for"
    )
    convert.add_argument(
        "--scorer", required=True, metavar="NAME", help="the scorer the curve was built with"
    )
    convert.add_argument("--out", type=Path, help="output file (default: CURVE with a .safetensors suffix)")
    convert.add_argument("--calibration", default="", help="what the curve was calibrated on")
    convert.add_argument("--head-dim", type=int, help="the model's head dimension, recorded in the profile")
    convert.set_defaults(func=_convert)


def _describe(profile: Profile) -> str:
    grid = profile.grid
    return (
        f"{profile.model_id} / {profile.scorer}: {profile.num_layers} layers x {profile.num_kv_heads} KV heads, "
        f"{grid.size} ratios in [{grid[0]:.2f}, {grid[-1]:.2f}], sink={profile.sink}, window={profile.window}, "
        f"created {profile.created} (lukv_cache {profile.library_version})"
    )


def _pull(args: argparse.Namespace) -> int:
    from .download import download_profile

    path = download_profile(args.model_id, args.scorer, hub=_hub(args), local_dir=args.local_dir)
    profile = Profile.load(path)
    print(_describe(profile))
    print(f"file: {path}")
    if args.out is not None:
        print(f"written to {profile.save(args.out)}")
    return 0


def _push(args: argparse.Namespace) -> int:
    from .index import save_to_local_dir

    profile = Profile.load(args.file)
    if args.local_dir:
        path = save_to_local_dir(profile, args.local_dir, args.model_id)
        print(f"written to {path} (and {Path(args.local_dir) / 'index.json'})")
        return 0
    sha = profile.push_to_hub(
        args.model_id, repo_id=args.repo_id, token=args.token, endpoint=args.endpoint, revision=args.revision
    )
    print(f"published {args.model_id or profile.model_id} / {profile.scorer} at commit {sha}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from .index import list_profiles

    entries = list_profiles(model_id=args.model_id, hub=_hub(args), local_dir=args.local_dir)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    if not entries:
        print("no profiles" + (f" for {args.model_id}" if args.model_id else ""))
        return 0
    rows = [("MODEL", "SCORER", "LAYERS x KV HEADS", "RATIOS", "CREATED")]
    for e in entries:
        grid = e.get("grid") or {}
        ratios = f"{grid.get('size', '?')} in [{grid.get('min', 0):.2f}, {grid.get('max', 0):.2f}]"
        shape = f"{e.get('num_layers', '?')} x {e.get('num_kv_heads', '?')}"
        rows.append((e["model_id"], e["scorer"], shape, ratios, str(e.get("created", ""))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert_curve

    profile = convert_curve(
        args.curve, args.model, args.scorer, calibration=args.calibration, head_dim=args.head_dim
    )
    out = profile.save(args.out if args.out is not None else args.curve.with_suffix(".safetensors"))
    print(_describe(profile))
    print(f"written to {out}")
    return 0
