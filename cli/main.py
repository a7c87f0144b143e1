"""`aigw`: one console script; one module of this package per part registers its subcommands.

    aigw serve ...            gateway    (cli/gateway.py)
    aigw replica|generate     engine     (cli/engine.py; needs `pip install 'aigw[engine]'`)
    aigw projects|keys|usage  auth       (cli/auth.py)
    aigw limits ...           run-time limits and budgets (cli/limits.py)
    aigw bench <what>         benchmarks (cli/bench.py: bench/ via engine/gateway)

Heavy modules are imported inside the subcommand handlers, so `aigw --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each entry: a module with `register(subparsers) -> None`; handlers are set with
# set_defaults(func=...).
_COMMAND_MODULES = ("cli.gateway", "cli.engine", "cli.auth", "cli.limits", "cli.bench")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `aigw` parser. With `argv`, the command line it is about to parse, a benchmark's
    module is imported only when argv runs that benchmark (`aigw --help` and `aigw keys ...`
    import no benchmark, the engine nor torch); without it, every flag of every subcommand."""
    parser = argparse.ArgumentParser(prog="aigw",
                                     description="AI gateway with its own inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # that part is not built yet
                continue
            raise
        if module_name == "cli.bench":
            module.register(subparsers, argv)
        else:
            module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from cli.gateway import attach_replica_args

    argv = attach_replica_args(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C before a server took SIGINT over (a replica still loading)
        print("aigw: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
