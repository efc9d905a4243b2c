"""The ``ridge`` command line.

Each concern registers its own subcommand (``register(subparsers)`` sets ``func``), so this
file only wires them and turns bad input into one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from ridge.bench import cli as bench_cli
    from ridge.engine import commands as engine_commands
    from ridge.roofline import cli as roofline_cli
    from ridge.router import cli as router_cli
    from ridge.server import cli as server_cli

    parser = argparse.ArgumentParser(
        prog="ridge",
        description="ridge: a readable LLM inference engine that knows its roofline.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    engine_commands.register(subparsers)
    roofline_cli.register(subparsers)
    server_cli.register(subparsers)
    router_cli.register(subparsers)
    bench_cli.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _log_to_stderr()
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotImplementedError) as exc:
        print(f"ridge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _log_to_stderr() -> None:
    """ridge's start-up log (what was loaded, quantized, allocated) as ``ridge: ...`` lines."""
    log = logging.getLogger("ridge")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("ridge: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
