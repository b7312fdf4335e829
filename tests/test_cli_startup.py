"""Start-up: ``lukv --help`` and every ``lukv <command> --help`` import neither torch nor transformers, every
option's help shows its default, and ``import lukv_cache`` is cheap while its public names still work."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from lukv_cache.cli import build_parser

HEAVY = ("torch", "transformers", "numpy", "safetensors", "huggingface_hub")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


COMMANDS = sorted(_subcommands(build_parser()))


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_command_is_covered():
    assert {"pull", "push", "list", "convert", "build", "show", "demo", "bench", "check"} <= set(COMMANDS)


def test_help_of_lukv_and_of_every_command_imports_no_heavy_module():
    code = f"""
import contextlib, io, json, sys
from lukv_cache.cli import main
helped = {{}}
for argv in [["--help"]] + [[c, "--help"] for c in {COMMANDS!r}]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit:
            pass
    helped[" ".join(argv)] = "usage: lukv" in out.getvalue()
print(json.dumps({{"helped": helped, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    result = _fresh(code)
    assert all(result["helped"].values()), result["helped"]
    assert result["heavy"] == [], f"lukv --help imported {result['heavy']}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_shows_its_default(command):
    parser = _subcommands(build_parser())[command]
    rendered = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.required or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            continue  # a flag: off unless given
        formatter = parser._get_formatter()
        text = formatter._expand_help(action) if action.help else ""
        assert "default" in text, f"lukv {command} {action.option_strings[0]}: no default in {text!r}"
    assert "(default: %" not in rendered


def test_import_lukv_cache_is_light_and_its_public_names_resolve():
    code = f"""
import json, sys
import lukv_cache
light = [m for m in {HEAVY!r} if m in sys.modules]
missing = [n for n in lukv_cache.__all__ if getattr(lukv_cache, n, None) is None]
print(json.dumps({{"light": light, "missing": missing, "dir": sorted(set(lukv_cache.__all__) - set(dir(lukv_cache)))}}))
"""
    result = _fresh(code)
    assert result == {"light": [], "missing": [], "dir": []}


@pytest.mark.parametrize(
    "lukv_first", [True, False], ids=["lukv-then-transformers", "transformers-then-lukv"]
)
def test_attention_routing_is_installed_whichever_is_imported_first(lukv_first):
    first, second = "import lukv_cache", "import transformers.modeling_utils"
    if not lukv_first:
        first, second = second, first
    code = f"""
import json
{first}
{second}
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
print(json.dumps({{n: ALL_ATTENTION_FUNCTIONS[n].__name__ for n in ("sdpa", "eager", "lukv")}}))
"""
    # the routing wrappers (a guarded stock function would be named lukv_guarded_sdpa)
    assert _fresh(code) == {
        "sdpa": "lukv_sdpa_attention_forward",
        "eager": "lukv_eager",
        "lukv": "lukv_sdpa_attention_forward",
    }


def test_lukv_version_answers_without_importing_torch():
    code = f"""
import contextlib, io, json, sys
from lukv_cache.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(["--version"])
    except SystemExit as exit:
        code = exit.code
print(json.dumps({{"out": out.getvalue(), "code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    import lukv_cache

    assert _fresh(code) == {"out": f"lukv {lukv_cache.__version__}\n", "code": 0, "heavy": []}


MISTAKES = [
    ["check", "smollm2", "--ratios", "2", "--calibration", "planted"],
    ["check", "smollm2", "--tolerance", "0", "--calibration", "planted"],
    ["check", "smollm2", "--max-new-tokens", "0", "--calibration", "planted"],
    ["check", "smollm2"],  # nothing to check
    ["check", "smollm2", "--text", "no-such-file.txt", "--questions", "q.txt"],
    ["check", "smollm2", "--calibration", "no-such-set"],
    ["check", "./no-such-model", "--calibration", "planted"],
    ["demo", "--ratios", "1.5"],
    ["demo", "--model", "./no-such-model"],
    ["bench", "--ratios", "1.5"],
    ["bench", "--tasks", "niah_multikey", "nope"],  # a task the bench does not have
    ["bench", "--kv-bits", "3"],
    ["build", "./no-such-model", "--out", "o"],
    ["show", "no-such-profile.safetensors", "--model", "./no-such-model"],
]


def test_argument_mistakes_are_refused_before_torch_is_imported():
    """Each mistake is refused at once: nothing heavy imported and no connection tried (a model, profile or
    Hub lookup would do both), checked after each one, not only after all."""
    code = f"""
import contextlib, io, json, socket, sys
from lukv_cache.cli import main
connects = []
def refuse(*args):  # getaddrinfo(host, port, ...) or socket.connect(self, address)
    connects.append(repr(args[1] if isinstance(args[0], socket.socket) else args[0]))
    raise OSError("the test allows no connection")
socket.getaddrinfo = refuse
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
results = []
for argv in {MISTAKES!r}:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue(), [m for m in {HEAVY!r} if m in sys.modules], connects[:]])
print(json.dumps({{"results": results}}))
"""
    result = _fresh(code)
    assert len(result["results"]) == len(MISTAKES)
    for argv, (code, err, heavy, connects) in zip(MISTAKES, result["results"]):
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert heavy == [], f"{argv} imported {heavy}"
        assert connects == [], f"{argv} tried to connect to {connects}"


NAME_MISTAKES = [  # argv, the kind and the name refused
    (["check", "smollm2", "--scorer", "nope", "--calibration", "planted"], "scorer", "nope"),
    (
        ["check", "smollm2", "--allocators", "uniform", "nope", "--calibration", "planted"],
        "allocator",
        "nope",
    ),
    (["bench", "--scorers", "keydiff,nope"], "scorer", "nope"),
    (["bench", "--scorers", "keydiff", "--allocators", "adakv", "nope"], "allocator", "nope"),
    (["build", "smollm2", "--scorer", "keydiff", "--scorer", "nope"], "scorer", "nope"),
]


def test_unknown_scorer_and_allocator_names_are_refused_before_torch_with_the_registrys_message():
    code = f"""
import contextlib, io, json, sys
from lukv_cache.cli import main
results = []
for argv, kind, name in {NAME_MISTAKES!r}:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
heavy = [m for m in {HEAVY!r} if m in sys.modules]
# what the registries say, as the commands did after the torch import
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.scorers import SCORERS
expected = []
for argv, kind, name in {NAME_MISTAKES!r}:
    try:
        {{"scorer": SCORERS, "allocator": ALLOCATORS}}[kind].get(name)
    except KeyError as error:
        expected.append(f"error: {{error}}\\n")
print(json.dumps({{"results": results, "heavy": heavy, "expected": expected}}))
"""
    result = _fresh(code)
    assert result["heavy"] == [], f"an unknown name imported {result['heavy']}"
    assert len(result["expected"]) == len(NAME_MISTAKES)
    for (argv, kind, name), (code, err), expected in zip(
        NAME_MISTAKES, result["results"], result["expected"]
    ):
        assert (code, err) == (2, expected), argv
        assert (
            err.startswith(f"error: Unknown {kind} {name!r}. Known {kind}s: ") and f"register_{kind}()" in err
        )


def test_built_in_names_pass_the_early_check():
    from lukv_cache.cli import prechecks

    parser = build_parser()
    check = parser.parse_args(
        ["check", "smollm2", "--scorer", "kvzap", "--allocators", "global", "threshold"]
    )
    prechecks.precheck_check(argparse.Namespace(**{**vars(check), "calibration": ["planted"]}))
    prechecks.precheck_bench(
        parser.parse_args(["bench", "--scorers", "kvzip,snapkv", "--allocators", "hybrid"])
    )
    prechecks.precheck_build(parser.parse_args(["build", "smollm2", "--scorer", "kvzap", "--scorer", "tova"]))


def test_every_positional_argument_has_help():
    for command, parser in _subcommands(build_parser()).items():
        for action in parser._actions:
            if not action.option_strings:
                assert action.help, f"lukv {command} {action.metavar or action.dest}: no help"


def test_bench_writes_under_the_lukv_cache_by_default_and_show_decomposes_on_builds_set(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("LUKV_CACHE_DIR", str(tmp_path))
    commands = _subcommands(build_parser())
    assert commands["bench"].parse_args([]).out == str(tmp_path / "bench")
    build = commands["build"].parse_args(["smollm2"])
    assert commands["show"].parse_args(["p.safetensors"]).calibration == build.calibration == "planted"


def test_show_model_says_what_it_is_doing_on_stderr_and_explains_its_table(monkeypatch, capsys):
    import lukv_cache.profiling.cli as profiling_cli
    from lukv_cache.cli import main

    monkeypatch.setattr(profiling_cli, "_show", lambda args: print("eviction loss at ratio 0.80") or 0)
    assert main(["show", "p.safetensors", "--model", "tiny", "--ratio", "0.8"]) == 0
    out, err = capsys.readouterr()
    assert "decomposing the eviction loss" in err and "'planted'" in err and "0.8" in err
    assert "floor:" in out and "gap:" in out and "loss = floor + gap" in out


def test_bench_prints_the_files_it_wrote(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent / "evaluation"))
    from demo_helpers import byte_tokenizer, tiny_llama

    from lukv_cache.cli import main
    from lukv_cache.evaluation import cli as evaluation_cli

    monkeypatch.setattr(evaluation_cli, "load_model", lambda *a, **k: (tiny_llama(), byte_tokenizer()))
    monkeypatch.setattr(evaluation_cli, "load_config", lambda *a, **k: tiny_llama().config)  # positions check
    monkeypatch.setenv("LUKV_CACHE_DIR", str(tmp_path))
    argv = ["bench", "--model", "tiny", "--tasks", "continuation", "--samples", "1", "--context-tokens", "64"]
    argv += [
        "--continuation-tokens",
        "8",
        "--ratios",
        "0.5",
        "--scorers",
        "keydiff",
        "--allocators",
        "uniform",
    ]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    written = sorted((tmp_path / "bench").iterdir())
    assert (
        written and last.startswith("wrote ") and all(str(p) in last for p in written if p.suffix != ".png")
    )
