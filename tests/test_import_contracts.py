"""The layers point one way: `lint-imports` checks pyproject.toml's [tool.importlinter] contracts
(engine/ and auth/ never import gateway/; the gateway, auth, chat, contracts and infra import
neither engine/ nor torch; contracts/ and infra/ import nothing of ours above them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports() -> str:
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert found, "lint-imports is missing: pip install -e '.[dev]' (import-linter)"
    return found


def test_the_import_contracts_hold() -> None:
    result = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_torch_import_in_infra_breaks_the_contracts(tmp_path: Path) -> None:
    """The checker itself: a copy of the tree where infra/ imports torch fails."""
    for package in ("cli", "bench", "gateway", "engine", "auth", "chat", "contracts", "infra"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "infra" / "leak.py").write_text("import torch\n")
    result = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={"PYTHONPATH": str(tmp_path),
                                                         "PATH": str(Path(sys.executable).parent)})
    assert result.returncode != 0
    assert "infra.leak -> torch" in result.stdout
