"""A virtualenv holding what `pip install aigw` installs, without torch: the project's wheel
(built from this checkout, no dependencies) plus its core dependencies, closed over their own
requirements, linked from this interpreter's site-packages (no download; seconds).

    venv = build_gateway_venv(tmp_dir)    # venv / "bin" / "aigw"
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "gateway", "engine", "auth", "bench", "chat", "contracts", "infra")


def core_requirements() -> list[Requirement]:
    """`[project] dependencies`: what `pip install aigw` brings, without any extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["dependencies"]]


def dependency_closure(requirements: list[Requirement]) -> dict[str,
                                                                importlib.metadata.Distribution]:
    """Every installed distribution those requirements pull in (markers evaluated here with the
    extras each was asked for), by normalized name; PackageNotFoundError if one is not installed."""
    found: dict[str, importlib.metadata.Distribution] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [req for req in requirements if req.marker is None or req.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if (name, frozenset(req.extras)) in done:
            continue
        done.add((name, frozenset(req.extras)))
        dist = found[name] = importlib.metadata.distribution(req.name)
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": extra})
                                         for extra in {"", *req.extras}):
                todo.append(sub)
    return found


def _top_level_entries(dist: importlib.metadata.Distribution) -> set[str]:
    """The site-packages entries a distribution installed (packages, modules, its .dist-info)."""
    entries = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            entries.add(first)
    return entries


def build_gateway_venv(where: Path) -> Path:
    """`where/venv`: python, the project's `aigw` entry point, the core dependencies, no torch."""
    site = Path(sysconfig.get_paths()["purelib"])
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    target = Path(subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    for dist in dependency_closure(core_requirements()).values():
        for entry in _top_level_entries(dist):
            if (site / entry).exists() and not (target / entry).exists():
                (target / entry).symlink_to(site / entry)
    source = where / "src"  # a copy: building in the checkout would write build/ into it
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "out"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(where / "wheel"),
                    str(source)], check=True, cwd=where)
    wheel = next((where / "wheel").glob("aigw-*.whl"))
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--no-index", str(wheel)], check=True)
    return venv
