"""``lukv pull | push | list | convert``: profiles from the shell.

Their flags are declared in :mod:`lukv_cache.cli.profiles_commands` (argparse alone, so ``--help`` stays
fast); it imports this module only when one of them runs. Each command returns an exit code and lets
:class:`~lukv_cache.errors.LUKVError` propagate (printed as one ``error:`` line, exit code 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .location import HubLocation
from .profile import Profile


def _hub(args: argparse.Namespace) -> HubLocation:
    return HubLocation(
        repo_id=args.repo_id,
        revision=args.revision,
        token=args.token,
        cache_dir=getattr(args, "cache_dir", None),
        endpoint=args.endpoint,
    )


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
