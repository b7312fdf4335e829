"""The wheel a user installs carries the shipped profiles: a fresh environment builds a SmolLM2 cache offline,
from a folder outside the checkout."""

from __future__ import annotations

import importlib.metadata
import os
import site
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# from_pretrained without a scorer takes the model's kvzap profile (its surrogate is in the file)
PROFILE = "lukv_cache/profiles_hub/HuggingFaceTB/SmolLM2-135M-Instruct/kvzap.safetensors"


def _unmet_build_requirements() -> list[str]:
    """pyproject's ``[build-system] requires`` this environment does not satisfy: ``--no-build-isolation``
    builds with the installed packages and pip does not check them (a virtual environment made with
    ``python -m venv`` carries its own old setuptools, which shadows a newer one and cannot build a wheel)."""
    unmet = []
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]:
        requirement = Requirement(line)
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{line} (installed: {installed or 'none'})")
    return unmet


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if unmet := _unmet_build_requirements():
        pytest.fail(
            f"{sys.executable} cannot build the wheel: it lacks the build requirements {', '.join(unmet)}. "
            "Install them there (pip install -e '.[dev]' does)."
        )
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    return next(out.glob("lukv_cache-*.whl"))


def test_the_wheel_contains_the_shipped_profiles_and_their_index(wheel):
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert PROFILE in names
    assert "lukv_cache/profiles_hub/index.json" in names
    # carried from the repository's top-level profiles_hub/ (setup.py's package_dir), file for file
    shipped = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "profiles_hub").rglob("*")
        if p.suffix in {".json", ".md", ".safetensors"}
    )
    assert (
        sorted(n.removeprefix("lukv_cache/") for n in names if n.startswith("lukv_cache/profiles_hub/"))
        == shipped
    )
    assert (
        archive.read("lukv_cache/profiles_hub/index.json")
        == (ROOT / "profiles_hub" / "index.json").read_bytes()
    )
    assert not any(n.startswith("profiles_hub/") for n in names)  # not a top-level package of its own
    assert "lukv_cache/profiling/calibration/default.jsonl" in names
    assert "lukv_cache/attention/cpu_codes.c" in names  # the CPU kernel's source, compiled on first use


def test_a_fresh_environment_builds_a_smollm2_cache_offline_from_the_wheel(wheel, tmp_path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    target = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # the dependencies (torch, transformers, ...) come from this environment; lukv_cache from the wheel only
    deps = [p for p in {sysconfig.get_paths()["purelib"], *site.getsitepackages()} if Path(p).is_dir()]
    (target / "deps.pth").write_text("\n".join(deps) + "\n")
    # pip installs the wheel into the fresh environment's site-packages (no dependencies, no index)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    script = (
        "import lukv_cache, sys\n"
        "from lukv_cache import LUKVCache\n"
        "assert '/env/' in lukv_cache.__file__, lukv_cache.__file__\n"
        "cache = LUKVCache.from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct', ratio=0.8)\n"
        "print(cache.profile.source)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": ""}
    env.pop("LUKV_PROFILE_DIR", None)
    result = subprocess.run(
        [python, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith(PROFILE.removeprefix("lukv_cache/"))
    assert str(env_dir) in result.stdout
