"""The `memalpha` console script. Each subcommand lives in `memalpha/commands/<name>.py` and exposes
`register(subparsers)`; this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import sys

from memalpha.config import ConfigError
from memalpha.errors import ServiceError, UserError

COMMANDS = ["config", "data", "sft", "train", "eval", "write", "export"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memalpha", description="Train memory-construction agents with GRPO.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"memalpha.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"memalpha.commands.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ConfigError, UserError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
