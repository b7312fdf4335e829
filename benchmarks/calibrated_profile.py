"""Add the score-to-gain table (profile format version 2) to a packaged model's shipped profiles.

The ``calibrated`` allocator reads it. The budgets and the kvzap surrogate stay as shipped (retraining the
surrogate is not needed for the table): each profile's own scorer scores the three shipped calibration
sets (planted facts, a story, explanations), the oracle decodes their questions, and
:func:`lukv_cache.profiling.with_score_gains` pools them. Neither the bench's Wikipedia texts nor the
tuning runs' news texts are read.

    python benchmarks/calibrated_profile.py --scorers kvzap keydiff --threads 1 --write-shipped
    python benchmarks/calibrated_profile.py --model qwen2.5-coder-0.5b --scorers kvzap --threads 1 --write-shipped

``--smoke``: kvzap and keydiff, the stand-ins of ``benchmarks/_smoke.py`` (their profiles in place of the
shipped ones, tiny calibration sets), written in a temporary folder, never over the shipped profiles
(``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _smoke
import torch

from lukv_cache import Profile
from lukv_cache.models import PACKAGED_MODELS, load_model
from lukv_cache.profiles import save_to_local_dir
from lukv_cache.profiling.gains import CENTRES, DEFAULT_CALIBRATIONS, DEFAULT_KNOTS, with_score_gains

HUB_MIRROR = Path(__file__).resolve().parents[1] / "profiles_hub"  # the shipped profiles and their index.json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(PACKAGED_MODELS), default="smollm2")
    parser.add_argument("--scorers", nargs="+", default=["kvzap"])
    parser.add_argument("--calibrations", nargs="+", default=list(DEFAULT_CALIBRATIONS))
    parser.add_argument("--knots", type=int, default=DEFAULT_KNOTS)
    parser.add_argument("--centre", choices=CENTRES, default="model")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--out", type=Path, default=None, help="a profiles folder (Hub layout) for the new files"
    )
    parser.add_argument("--write-shipped", action="store_true", help="replace the shipped profiles")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    shipped = HUB_MIRROR / PACKAGED_MODELS[args.model].model_id  # <owner>/<name>: the Hub layout
    if args.smoke:
        smoke = _smoke.begin()
        shipped, args.out, args.write_shipped = smoke.profile("kvzap").parent, smoke.out("calibrated"), False
        args.scorers, args.calibrations, args.threads = ["kvzap", "keydiff"], list(DEFAULT_CALIBRATIONS), 1
        args.model = "smollm2"
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    for scorer in args.scorers:
        started = time.perf_counter()
        profile = Profile.load(shipped / f"{scorer}.safetensors")
        new = with_score_gains(
            profile, model, tokenizer, args.calibrations, knots=args.knots, centre=args.centre
        )
        # <folder>/<model id>/<scorer>.safetensors and its index.json entry (what --profiles reads)
        for folder in [args.out] * (args.out is not None) + [HUB_MIRROR] * args.write_shipped:
            print(save_to_local_dir(new, folder))
        print(f"{scorer}: table {new.gain_scores.shape} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
