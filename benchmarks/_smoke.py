"""What the benchmarks' ``--smoke`` runs use instead of SmolLM2, real text and the shipped profiles.

``benchmarks/smoke.py`` runs every script with ``--smoke``: its own code path end to end, in seconds, on
tiny stand-ins, so that a script that no longer runs fails CI. The figures mean nothing. :func:`begin`
makes a temporary folder outside the repository (removed at exit) for everything a smoke run writes and,
with ``stand_ins=True``, puts in place (for this process only):

* the model: ``load_model("smollm2")`` and ``load_smollm2()`` load a tiny random Llama
  (:func:`lukv_cache.testing.tiny_model`: 2 layers, 4 query / 2 KV heads, head_dim 32, 8k positions)
  with a byte-level tokenizer (:func:`lukv_cache.testing.byte_tokenizer`), saved in the folder; it carries
  SmolLM2's Hub id, so the scripts look its profiles up as they look up SmolLM2's;
* its profiles: a tiny profile for each scorer SmolLM2 has one for (kvzap with a seeded random surrogate,
  keydiff and kvzap with a score-to-gain table), in a mirror named by ``$LUKV_PROFILE_DIR``;
* the text: synthetic prose (:func:`lukv_cache.testing.prose`) for gensim's Wikipedia and news articles,
  and tiny calibration sets under the shipped sets' names (Python's documentation, part of CPython, stays);
* the caches: ``$LUKV_CACHE_DIR`` (build results, KVzip+ targets, ``lukv bench`` output) in the folder;
  the Hub offline.

Every smoke run prints a line starting with ``smoke:`` (``benchmarks/smoke.py`` checks it), and one
starting with ``smoke: skipped`` for each part it leaves out.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

HELP = "run in seconds on tiny stand-ins (benchmarks/_smoke.py), outputs in a temporary folder"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the id the stand-in model carries
# the scorers SmolLM2-135M-Instruct has shipped profiles for (profiles_hub/)
SCORERS = ("keydiff", "snapkv", "expected_attention", "knorm", "kvzip", "kvzap")
GAINS = ("keydiff", "kvzap")  # the shipped profiles with a score-to-gain table
SHAPE = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@dataclass(frozen=True)
class Smoke:
    """A smoke run's temporary folder and, with stand-ins, where they lie."""

    folder: Path  # everything the run writes goes under it
    model_dir: Path | None = None  # the stand-in model's folder (what ``smollm2_path()`` returns)
    profiles: Path | None = None  # the stand-in profiles' mirror ($LUKV_PROFILE_DIR)

    def out(self, name: str) -> Path:
        """A path (file or folder) for ``name`` inside the temporary folder."""
        return self.folder / name

    def profile(self, scorer: str) -> Path:
        """The stand-in profile file for ``scorer``."""
        assert self.profiles is not None, "begin(stand_ins=True) publishes the profiles"
        return self.profiles / SMOLLM2_ID / f"{scorer}.safetensors"


_current: Smoke | None = None


def begin(stand_ins: bool = True, note: str = "") -> Smoke:
    """Start a smoke run (once per process; later calls return the same): the temporary folder, and the
    stand-ins unless ``stand_ins`` is False. Prints the ``smoke:`` line, with ``note`` after it."""
    global _current
    if _current is not None:
        return _current
    folder = Path(tempfile.mkdtemp(prefix="lukv-smoke-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ.setdefault("MPLBACKEND", "Agg")
    if not stand_ins:
        _current = Smoke(folder)
        print(f"smoke: tiny sizes, outputs in {folder} (removed at exit){note}", flush=True)
        return _current
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
        os.environ[name] = value
    os.environ["LUKV_CACHE_DIR"] = str(folder / "cache")
    os.environ["LUKV_PROFILE_DIR"] = str(folder / "profiles")
    _offline()
    _current = Smoke(folder, _model(folder / "smollm2"), folder / "profiles")
    _profiles(_current.profiles)
    _texts()
    _calibrations(folder / "calibration")
    print(
        f"smoke: a tiny random Llama standing in for {SMOLLM2_ID}, synthetic text, tiny calibration sets "
        f"and profiles, outputs in {folder} (removed at exit); the figures mean nothing{note}",
        flush=True,
    )
    return _current


def skipped(what: str) -> None:
    """Say that the smoke run leaves ``what`` out (``benchmarks/smoke.py`` repeats these lines)."""
    print(f"smoke: skipped {what}", flush=True)


def _offline() -> None:
    import sys

    constants = sys.modules.get("huggingface_hub.constants")  # read at import: set it too if imported
    if constants is not None:
        constants.HF_HUB_OFFLINE = True


def _model(folder: Path) -> Path:
    """Save the tiny model and its tokenizer, and make ``smollm2_path()`` return their folder."""
    from transformers.utils import logging

    import lukv_cache.models
    from lukv_cache.testing import BYTE_VOCAB, byte_tokenizer, tiny_model

    logging.disable_progress_bar()  # saving and loading a 2-layer model: no bars
    model = tiny_model(
        vocab_size=BYTE_VOCAB,
        max_position_embeddings=8192,
        pad_token_id=256,
        name_or_path=SMOLLM2_ID,
        **SHAPE,
    )
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    provenance = {  # what smollm2_provenance() reads (lukv bench records it)
        "model_id": SMOLLM2_ID,
        "source_package": "smoke stand-in",
        "source_package_version": "0",
        "source_file": "lukv_cache.testing.tiny_model",
        "source_size": 0,
        "quantization": "none: random float32 weights",
        "conversion_version": 0,
        "converted_seconds": 0.0,
    }
    (folder / "lukv_provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")

    real = lukv_cache.models.packaged_path

    def packaged_path(name: str = "smollm2", cache_dir=None, *, verbose: bool = False) -> Path:
        if name in ("smollm2", SMOLLM2_ID):
            return folder
        return real(name, cache_dir, verbose=verbose)

    def smollm2_path(cache_dir=None, *, verbose: bool = False) -> Path:
        return folder

    # every loader of the packaged models reads packaged_path (load_model, load_smollm2, load_config,
    # the provenance); smollm2_path for callers that name it
    lukv_cache.models.packaged_path = packaged_path
    lukv_cache.models.smollm2_path = smollm2_path
    return folder


def _surrogate():
    """A seeded random kvzap surrogate of the stand-in's shape, on the shipped profile's features."""
    from lukv_cache.testing import random_surrogate

    layers, heads = SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"]
    surrogate = random_surrogate(layers, heads, SHAPE["head_dim"], scale=0.1)  # SmolLM2's feature set
    surrogate.meta = {"corpus": "none (smoke stand-in: random weights)", "family": "linear"}
    return surrogate


def _profiles(mirror: Path) -> None:
    import numpy as np

    from lukv_cache.profiles import save_to_local_dir
    from lukv_cache.scorers import get_scorer
    from lukv_cache.testing import curve_profile, with_gains

    grid = np.linspace(0.05, 0.95, 19, dtype=np.float32)
    layers, heads = SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"]
    for scorer in SCORERS:
        extra = {"surrogate": _surrogate()} if scorer == "kvzap" else {}
        profile = curve_profile(
            layers, heads, grid, spread=0.04, model_id=SMOLLM2_ID, scorer=scorer, head_dim=SHAPE["head_dim"],
            window=get_scorer(scorer).window, calibration="smoke stand-in", **extra,
        )  # fmt: skip
        save_to_local_dir(with_gains(profile) if scorer in GAINS else profile, mirror)


def _articles(prefix: str, paragraphs: list[int], chars: int, seed: int):
    """Articles of ``paragraphs[i]`` paragraphs of ``chars`` characters of synthetic prose each."""
    from lukv_cache.testing import prose
    from lukv_cache.texts import Article

    return tuple(
        Article(f"{prefix} {i}", "\n\n".join(prose(chars, seed=seed + 100 * i + j) for j in range(n)))
        for i, n in enumerate(paragraphs)
    )


def _texts() -> None:
    """Synthetic prose for gensim's articles (one token a character): 12 'Wikipedia' articles of paragraphs
    of 800 characters, every fourth one 32 of them (25,600 characters: enough for the kvzap scripts' 4k-token
    documents), the others 4; 60 'news' articles of one 500-character paragraph."""
    from lukv_cache.texts import use_articles

    wikipedia = _articles("Synthetic article", [32 if i % 4 == 0 else 4 for i in range(12)], 800, seed=0)
    news = _articles("news", [1] * 60, 500, seed=10_000)
    use_articles(wikipedia=wikipedia, news=news)


def _calibrations(folder: Path) -> None:
    """Tiny calibration sets under the shipped sets' names: a 600-character context, three questions."""
    import lukv_cache.profiling.calibration as calibration
    from lukv_cache.testing import prose

    folder.mkdir(parents=True)
    for seed, name in enumerate(calibration.shipped_calibrations()):
        rows = [{"type": "context", "title": f"smoke stand-in for {name}", "text": prose(600, seed=seed)}]
        rows += [
            {"type": "question", "text": f"What is said about the {word}?", "answer": word, "where": where}
            for word, where in (("river", "early"), ("market", "middle"), ("harbour", "late"))
        ]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    calibration.SHIPPED_FOLDER = folder  # calibration_path() and shipped_calibrations() read it


def bench_results(folder: Path, name: str, **settings) -> Path:
    """The JSON file ``lukv bench`` writes, of a tiny run on the stand-ins (what the table scripts read):
    multikey retrieval and continuation, two samples of 200 tokens, keydiff under uniform at 0.5, unless
    ``settings`` (:class:`~lukv_cache.evaluation.runner.BenchSettings` fields) say otherwise."""
    from lukv_cache.evaluation.report import write_results
    from lukv_cache.evaluation.runner import BenchSettings, run_benchmark
    from lukv_cache.models import load_model

    begin()
    model, tokenizer = load_model("smollm2")
    fields = dict(tasks=("niah_multikey", "continuation"), samples=2, context_tokens=200, ratios=(0.5,))
    fields |= dict(scorers=("keydiff",), allocators=("uniform",), needles=2, continuation_tokens=8)
    results = run_benchmark(model, tokenizer, BenchSettings(**(fields | settings)), log=None)
    results.command = f"smoke stand-in ({name}): lukv_cache.evaluation.runner.run_benchmark on the stand-ins"
    return write_results(results, folder, name)["json"]
