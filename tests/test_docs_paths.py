"""The paths the documentation cites exist, and no tracked file names a path of one machine.

Cited: every repository path (``benchmarks/...``, ``docs/...``, ``examples/...``, ``tests/...``,
``lukv_cache/...``) in a code span, a code block or a link target of README.md, CONTRIBUTING.md,
benchmarks/README.md and docs/*.md, and in the docstrings, comments and strings of lukv_cache's modules.
A ``*`` or a ``<placeholder>`` in a path is a pattern: some file must match it.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w./-])(?:\.\./)*(?:benchmarks|docs|examples|tests|lukv_cache)/[\w.\-/*<>{}]*")
CODE = re.compile(r"^```.*?^```|`[^`]+`", re.M | re.S)  # code blocks, then code spans (one may wrap)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# cited paths that are not files of the repository, with the reason
NOT_IN_THE_REPOSITORY = {
    "lukv_cache/profiles_hub/": "the wheel's copy of the top-level profiles_hub/ (setup.py maps it there)",
}
# experiments that moved beside their results, as lukv_cache's comments still name them (the package's owners
# update those comments, then drop the entry): old path -> where it lies now, which must exist
# absolute paths of one machine: scratch folders, home folders, the workspace
MACHINE_PATH = re.compile(
    r"(?<![\w.~-])/(?:tmp|var/tmp|work|home|root|Users|mnt|scratch|private)/[^\s'\"`)\]},;]*"
)
# file -> (the path it may name, and the folders under it; why it stays)
MACHINE_PATHS_ALLOWED = {
    "benchmarks/gpu_check.py": ("/tmp/gpu_check_toy.json", "the docstring's example output file, any folder"),
    "benchmarks/kvpress_efficiency.py": ("/tmp/kvpress-venv", "the throwaway venv its recipe creates first"),
    "benchmarks/kvpress_ruler.py": (
        "/tmp/kvp",
        "the venv its recipe creates first (kvpress needs transformers < 5.3)",
    ),
    "benchmarks/results/ruler/kvpress_env.txt": ("/tmp/kvp", "that venv, as it was made"),
    "benchmarks/results/install/fresh_venvs.sh": ("/tmp/lukv-fresh-venvs", "its own work folder, recreated"),
    "tests/profiles/test_profile_hub.py": ("/home/me/models/llama", "a made-up folder the test passes"),
}


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def _text(name: str) -> str | None:
    data = (ROOT / name).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _docs() -> list[str]:
    tracked = set(_tracked())
    named = ["README.md", "CONTRIBUTING.md", "benchmarks/README.md"]
    return [n for n in named if n in tracked] + sorted(
        n for n in tracked if n.startswith("docs/") and n.endswith(".md")
    )


def _markdown_cites(text: str) -> list[str]:
    spans = [m.group(0) for m in CODE.finditer(text)] + LINK.findall(text)
    return [p.group(0) for span in spans for p in PATH.finditer(span)]


def _python_cites(text: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [
        p.group(0)
        for tok in tokens
        if tok.type in (tokenize.COMMENT, tokenize.STRING)
        for p in PATH.finditer(tok.string)
    ]


def _exists(cited: str, source: str) -> bool:
    path = cited.split("::")[0].rstrip(".")
    base = (ROOT / source).parent if path.startswith("../") else ROOT
    if path in NOT_IN_THE_REPOSITORY:
        return True
    if re.search(r"[*<{]", path):
        pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", path)
        return any(base.glob(pattern.rstrip("/")))
    return (base / path).resolve().exists()


def _cites() -> list[tuple[str, str]]:
    cites = [(source, c) for source in _docs() for c in _markdown_cites(_text(source) or "")]
    for source in _tracked():
        if source.startswith("lukv_cache/") and source.endswith(".py"):
            cites += [(source, c) for c in _python_cites(_text(source) or "")]
    return cites


def test_the_documentation_cites_paths():
    cited = {c for _, c in _cites()}
    assert len(cited) > 100 and "docs/design.md" in cited  # the scan reads what it should


def test_every_path_the_documentation_cites_exists():
    missing = sorted({f"{source}: {cited}" for source, cited in _cites() if not _exists(cited, source)})
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_no_tracked_file_names_a_path_of_one_machine():
    found = []
    for name in _tracked():
        if name == "tests/test_docs_paths.py":
            continue  # names the patterns
        text = _text(name)
        allowed = MACHINE_PATHS_ALLOWED.get(name, ("//", ""))[0]
        for m in MACHINE_PATH.finditer(text or ""):
            if m.group(0) != allowed and not m.group(0).startswith(allowed + "/"):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{name}:{line}: {m.group(0)}")
    assert not found, (
        "absolute paths of one machine (write <scratch>/... in a recorded command, or take the folder "
        "from $SCRATCH / an argument in a script):\n" + "\n".join(found)
    )
