"""The user docs (README.md, docs/**/*.md) stay true to the tree they ship with.

- every relative link and image resolves to a file, and every `#anchor` to a heading;
- every repository path a page names (`gateway/routing/scoring.py`) exists, and every command in
  its code (`aigw keys create`, `python -m bench.fp8_quality`, `make run`);
- no page reads as a log of past work (dated runs, commit hashes, "this session", "the issue"):
  run logs belong in bench/results/;
- docs/reference/cli.md documents every `aigw` subcommand and flag, and no flag that is gone;
- docs/reference/metrics.md names every Prometheus metric of gateway and replica, and no other.
"""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# The repo hook's patterns (hooks/before-stop, section 3) plus commit hashes, dated runs and
# ticket references: what a page says must be what is true now, not when or by whom it was found.
DIARY = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|this|last|previous|earlier|another)"
    r" session\b|\bthe issue'?s?\b|\b(run|check|re-run) of 20[0-9]{2}-"
    r"|\b(commit|HEAD) [0-9a-f]{7,40}\b|\b(measured|run|re-run|checked) (on |at "
    r")?20[0-9]{2}-[0-9]{2}-"
    r"|\bissue #[0-9]+|\(#[0-9]+\)",
    re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
TOP_DIRS = ("auth", "bench", "chat", "contracts", "deploy", "docs", "engine", "gateway", "infra",
            "scripts", "tests", ".ci")
# Paths a page names that a command writes, not the repository holds.
GENERATED = ("bench/out",)
_TOP = "|".join(map(re.escape, TOP_DIRS))
CODE_PATH = re.compile(rf"`((?:{_TOP})/[A-Za-z0-9_./-]*)(?::[0-9-]+)?`"  # `engine/kv_cache/`
                       # a file in prose
                       rf"|(?<![\w/.$-])((?:{_TOP})/[A-Za-z0-9_./-]*\.[a-z]{{1,4}})\b")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced code blocks (links and anchors live in prose)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _prose(page.read_text()), re.MULTILINE)
    return {_slug(h) for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve_to_files_and_headings(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {_rel(linked)}")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_repository_paths_a_page_names_exist(page: Path) -> None:
    named = {quoted or bare for quoted, bare in CODE_PATH.findall(page.read_text())}
    missing = sorted({path for path in named
                      if not any(c in path for c in "*<>{}")
                      and not path.startswith(GENERATED)
                      and not (ROOT / path.rstrip("/")).exists()})
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_page_is_reference_not_a_log_of_past_work(page: Path) -> None:
    hits = [f"line {n}: {line.strip()[:120]}" for n, line in
            enumerate(page.read_text().splitlines(), 1) if DIARY.search(line)]
    assert not hits, (f"{_rel(page)} reads as a log of past work (put runs in bench/results/, "
                      "keep the current figure and its command):\n" + "\n".join(hits))


def test_the_diary_pattern_catches_what_the_hook_catches() -> None:
    for line in ("in the fifth session we", "the issue's target", "a run of 2026-11-30 at",
                 "HEAD 3bfdbb1", "after commit defb586", "Measured 2026-11-29 on", "see (#8)"):
        assert DIARY.search(line), line
    for line in ("session affinity per `x-session-id`", "8 sessions x 4 turns",
                 "`--since 2026-11-29`", "issues are welcome"):
        assert not DIARY.search(line), line


# ---- commands a page names: `aigw ...`, `python -m ...`, `make ...`

CODE = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)


def _code_text(page: Path) -> str:
    return "\n".join(CODE.findall(page.read_text()))


def test_commands_the_pages_name_exist() -> None:
    tree = _command_tree(_aigw_parser())
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    problems = []
    for page in PAGES:
        code = _code_text(page)
        for first, second in re.findall(r"(?<!-n )(?<![\w/.-])aigw ([a-z][\w-]*)(?: "
                                        r"([a-z][\w-]*))?", code):
            if first not in tree:
                problems.append(f"{_rel(page)}: `aigw {first}` is no command")
            elif second and tree[first] and second not in tree[first]:
                problems.append(f"{_rel(page)}: `aigw {first} {second}` is no command")
        for module in re.findall(r"\bpython3? -m ([\w.]+)", code):
            path = ROOT / module.replace(".", "/")
            if module.split(".")[0] in TOP_DIRS and not (path.with_suffix(".py").exists()
                                                         or (path / "__main__.py").exists()):
                problems.append(f"{_rel(page)}: `python -m {module}`: no such module")
        problems += [f"{_rel(page)}: `make {target}`: no such target"
                     for target in re.findall(r"\bmake ([a-z][\w-]*)", code)
                     if target not in targets]
    assert not problems, "\n".join(problems)


def _command_tree(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """'keys' -> {'create', 'list', ...}; a command without subcommands -> set()."""
    tree: dict[str, set[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                tree[name] = {n for a in sub._actions if isinstance(a, argparse._SubParsersAction)
                              for n in a.choices}
    return tree


# ---- docs/reference/cli.md against the argument parser behind `aigw --help`

def _aigw_parser() -> argparse.ArgumentParser:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module_name = scripts["aigw"].split(":")[0]
    parser: argparse.ArgumentParser = importlib.import_module(module_name).build_parser()
    return parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("aigw",)
              ) -> dict[str, set[str]]:
    """'aigw keys create' -> its option strings, for every parser that takes options itself."""
    found: dict[str, set[str]] = {}
    subcommands: dict[str, argparse.ArgumentParser] = {}
    options: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subcommands.update(action.choices)
        elif not isinstance(action, argparse._HelpAction):
            options.update(s for s in action.option_strings if s.startswith("--"))
    if not subcommands:
        found[" ".join(path)] = options
    for name, sub in subcommands.items():
        found.update(_commands(sub, (*path, name)))
    return found


def _cli_sections() -> dict[str, str]:
    text = (ROOT / "docs" / "reference" / "cli.md").read_text()
    parts = re.split(r"^##+ `(aigw[^`]*)`.*$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_cli_reference_documents_every_subcommand_and_flag_of_aigw() -> None:
    sections = _cli_sections()
    problems = []
    for command, options in _commands(_aigw_parser()).items():
        if command not in sections:
            problems.append(f"no section '## `{command}`'")
            continue
        named = set(re.findall(r"`(--[a-z0-9-]+)", sections[command]))
        problems += [f"{command}: {flag} undocumented" for flag in sorted(options - named)]
        problems += [f"{command}: documents {flag}, which it does not take"
                     for flag in sorted(named - options)]
    commands = set(_commands(_aigw_parser()))
    problems += [f"section for '{name}', which is no command" for name in sections
                 if name not in commands]
    assert not problems, "docs/reference/cli.md vs `aigw --help`:\n" + "\n".join(problems)


def test_cli_reference_overview_lists_every_subcommand() -> None:
    """The page's first block (`aigw keys create|list|revoke|rotate`, ...) names every command
    and each of its subcommands (it once left four benchmarks out)."""
    text = (ROOT / "docs" / "reference" / "cli.md").read_text()
    overview = text.split("```text\n", 1)[1].split("```", 1)[0]
    listed: dict[str, set[str]] = {}
    for command, subcommands in re.findall(r"^aigw ([a-z][\w-]*) ?(\S*)", overview, re.MULTILINE):
        listed[command] = set(subcommands.split("|")) if "|" in subcommands else set()
    problems = []
    for command, subcommands in _command_tree(_aigw_parser()).items():
        if command not in listed:
            problems.append(f"`aigw {command}` is not in the overview")
        elif subcommands - listed[command]:
            problems.append(f"`aigw {command}`: {sorted(subcommands - listed[command])} missing")
    assert not problems, "\n".join(problems)


# ---- docs/reference/metrics.md against the registries behind GET /metrics

class _NoEndpoints:
    def all_endpoints(self) -> list[Any]:
        return []


class _Stats:
    def __getattr__(self, name: str) -> int:
        return 1


def _exported_names() -> set[str]:
    from engine.server.metrics import ReplicaMetrics
    from gateway.telemetry.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    gateway.attach_fleet(_NoEndpoints())  # type: ignore[arg-type]
    replica = ReplicaMetrics(_Stats, model="m", replica="r").registry
    suffix = {"counter": "_total"}
    return {family.name + suffix.get(family.type, "")
            for registry in (gateway, replica) for family in registry.collect()}


def test_metrics_reference_names_every_exported_metric_and_no_other() -> None:
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    documented = set(re.findall(r"`(aigw_[a-z0-9_]+)`", text))
    exported = _exported_names()
    assert not exported - documented, f"undocumented metrics: {sorted(exported - documented)}"
    assert not documented - exported, f"documented, not exported: {sorted(documented - exported)}"


# ---- docs/reference/configuration.md against the settings classes and the environment reads

PACKAGES = ("auth", "chat", "contracts", "engine", "gateway", "infra")
# Variables the code reads that are not for users to set.
INTERNAL_VARIABLES = {"AIGW_EMBEDDED_RESTARTS_FILE"}  # `aigw serve` sets it for its own workers


def _settings_models() -> list[Any]:
    from auth.settings import AuthSettings
    from gateway.settings import GatewaySettings

    models, todo = [], [GatewaySettings, AuthSettings]
    while todo:
        model = todo.pop()
        models.append(model)
        for info in model.model_fields.values():
            for inner in re.findall(r"\b[A-Z]\w+\b", repr(info.annotation)):
                found = getattr(importlib.import_module(model.__module__), inner, None)
                if hasattr(found, "model_fields") and found not in models + todo:
                    todo.append(found)
    return models


def _variables_read_by_the_code() -> set[str]:
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](AIGW_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    return names - INTERNAL_VARIABLES


def test_configuration_reference_names_every_setting_and_variable() -> None:
    from auth.settings import AuthSettings
    from gateway.settings import GatewaySettings

    text = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    problems = [f"setting {model.__name__}.{name} undocumented"
                for model in _settings_models() if model is not AuthSettings
                for name in model.model_fields
                if not re.search(rf"`(?:[\w.<> -]*\.)?{name}[`.]", text)]
    documented = set(re.findall(r"\b(AIGW_[A-Z0-9_]*[A-Z0-9])\b", text))
    read = _variables_read_by_the_code()
    problems += [f"variable {name} undocumented" for name in sorted(read - documented)]
    from_fields = {f"AIGW_{name.upper()}" for model in (GatewaySettings, AuthSettings)
                   for name in model.model_fields}
    problems += [f"documents {name}, which nothing reads" for name in sorted(documented)
                 if name not in read | from_fields and name.split("__")[0] not in from_fields]
    assert not problems, "docs/reference/configuration.md:\n" + "\n".join(problems)
