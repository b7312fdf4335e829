"""The profile commands' flags: ``lukv pull``, ``push``, ``list`` and ``convert``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..profiles.location import DEFAULT_REPO_ID, DEFAULT_SCORER, LOCAL_DIR_ENV, REPO_ID_ENV
from .declare import add_command, lazy_command


def _hub_options(parser: argparse.ArgumentParser, *, revision_help: str) -> None:
    parser.add_argument(
        "--repo-id", help=f"shared profile repository (default: ${REPO_ID_ENV} or {DEFAULT_REPO_ID})"
    )
    parser.add_argument("--revision", help=revision_help)
    parser.add_argument("--endpoint", help="Hub endpoint (default: huggingface_hub's, i.e. $HF_ENDPOINT)")
    parser.add_argument("--token", help="Hub token (default: huggingface_hub's stored token / $HF_TOKEN)")


def profiles_commands(subparsers: Any) -> None:
    run = "lukv_cache.profiles.cli"
    pull = add_command(subparsers, "pull", "download the shared profile of a model (into the Hub cache)")
    pull.add_argument("model_id", metavar="MODEL_ID", help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    pull.add_argument("--scorer", default=DEFAULT_SCORER, help="scorer the profile was built for")
    _hub_options(pull, revision_help="branch, tag or commit sha of the shared repository (default: main)")
    pull.add_argument(
        "--out", type=Path, help="also write a copy of the profile to this file (default: none)"
    )
    pull.add_argument("--cache-dir", help="huggingface_hub cache folder (default: its usual one)")
    pull.add_argument("--local-dir", help=f"folder of profiles searched first (default: ${LOCAL_DIR_ENV})")
    pull.set_defaults(func=lazy_command(run, "_pull"))

    push = add_command(subparsers, "push", "publish a profile file to the shared repository")
    push.add_argument("file", metavar="FILE", type=Path, help="a profile (.safetensors)")
    push.add_argument("--model-id", help="publish under this model id (default: the one in the file)")
    _hub_options(push, revision_help="branch to commit to (default: main)")
    push.add_argument(
        "--local-dir",
        help="write into this local mirror (e.g. profiles_hub/) and its index instead of the Hub "
        "(default: the Hub)",
    )
    push.set_defaults(func=lazy_command(run, "_push"))

    listing = add_command(subparsers, "list", "list the profiles in the shared repository")
    listing.add_argument("--model-id", help="only this model's profiles (default: every model's)")
    _hub_options(listing, revision_help="branch, tag or commit sha (default: main)")
    listing.add_argument(
        "--local-dir", help="list a local mirror (e.g. profiles_hub/) instead of the Hub (default: the Hub)"
    )
    listing.add_argument("--cache-dir", help="huggingface_hub cache folder (default: its usual one)")
    listing.add_argument("--json", action="store_true", help="print the index entries as JSON")
    listing.set_defaults(func=lazy_command(run, "_list"))

    convert = add_command(
        subparsers, "convert", "turn a LU-KV / kvpress curve (.npy [99, L, H_kv]) into a profile"
    )
    convert.add_argument(
        "curve",
        metavar="CURVE.npy",
        type=Path,
        help="a numpy array [99, layers, kv heads]: each head's eviction ratio at global ratios 0.01 ... 0.99",
    )
    convert.add_argument(
        "--model", required=True, metavar="MODEL_ID", help="the model id the curve was built for"
    )
    convert.add_argument(
        "--scorer", required=True, metavar="NAME", help="the scorer the curve was built with"
    )
    convert.add_argument("--out", type=Path, help="output file (default: CURVE with a .safetensors suffix)")
    convert.add_argument("--calibration", default="", help="what the curve was calibrated on (default: '')")
    convert.add_argument(
        "--head-dim",
        type=int,
        help="the model's head dimension, recorded in the profile (default: unrecorded)",
    )
    convert.set_defaults(func=lazy_command(run, "_convert"))
