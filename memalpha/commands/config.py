"""`memalpha config show`: print the resolved configuration."""

from __future__ import annotations

import yaml

from memalpha.config import load_config


def register(subparsers) -> None:
    parser = subparsers.add_parser("config", help="show the resolved run configuration")
    parser.add_argument("--config", help="YAML config file (default: embedded defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.set_defaults(handler=_show)


def _show(args) -> int:
    config = load_config(args.config, args.set)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0
