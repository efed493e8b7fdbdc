"""ServerConfig from env vars and flags: the one place the environment is read.

Each field is settable as env var `NAME` (or the aliases its metadata lists) or flag `--name`,
the flag winning (TGIS launcher semantics, tgis-interface.md §3.1). Boolean switches follow
clap's "flag + env" rule: any env value other than n/no/f/false/off/0 (or empty) enables them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from server.config import ServerConfig

_FALSE_WORDS = frozenset({"", "n", "no", "f", "false", "off", "0"})
_IGNORED_LAUNCHER_FLAGS = (
    "--num-shard",
    "--deployment-framework",
    "--master-addr",
    "--master-port",
    "--shard-uds-path",
    "--max-waiting-tokens",
    "--max-prefill-padding",
    "--batch-safety-margin",
    "--max-batch-weight",
    "--max-prefill-weight",
)
"""TGIS launcher flags (§2.4, §3.1) that are accepted for compatibility and have no effect."""


def config_from_env_and_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """See `ServerConfig.from_env_and_args`."""
    env = os.environ if env is None else env
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in fields(ServerConfig):
        env_names = f.metadata["env"] or (f.name.upper(),)
        flag_value = getattr(args, f.name)
        if flag_value is not None:
            values[f.name] = _parse(f, flag_value, f"--{f.name.replace('_', '-')}")
            continue
        set_envs = [(n, env[n]) for n in env_names if n in env]
        parsed = {n: _parse(f, v, n) for n, v in set_envs if v != "" or f.metadata["switch"]}
        if len(set(parsed.values())) > 1:
            raise ValueError(f"{f.name}: conflicting values {parsed}")
        if parsed:
            values[f.name] = next(iter(parsed.values()))
    return ServerConfig(**values)


def _parse(f: dataclasses.Field[Any], raw: str | bool, source: str) -> Any:
    if isinstance(raw, bool):
        return raw
    kind = str(f.type)
    try:
        if f.metadata["switch"]:
            return raw.strip().lower() not in _FALSE_WORDS
        if kind.startswith("bool"):
            word = raw.strip().lower()
            if word in ("true", "1", "yes", "y", "on", "t"):
                return True
            if word in ("false", "0", "no", "n", "off", "f"):
                return False
            raise ValueError("expected true or false")
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        return raw
    except ValueError as e:
        raise ValueError(f"{f.name}: invalid value {raw!r} from {source}: {e}") from None


def build_arg_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per ServerConfig field, help text from the field's docstring."""
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="TGIS-compatible gRPC inference server. Every flag can also be set as an "
        "env var of the same name in upper case.",
    )
    for f in fields(ServerConfig):
        flag = f"--{f.name.replace('_', '-')}"
        env_names = f.metadata["env"] or (f.name.upper(),)
        help_text = f"{f.metadata['doc']} [env: {', '.join(env_names)}]".replace("%", "%%")
        names = [flag, *f.metadata["flags"]]
        if f.metadata["switch"]:
            parser.add_argument(
                *names, dest=f.name, action="store_const", const=True, default=None, help=help_text
            )
        else:
            parser.add_argument(*names, dest=f.name, default=None, help=help_text)
    for flag in _IGNORED_LAUNCHER_FLAGS:
        parser.add_argument(flag, dest=f"ignored_{flag[2:]}", default=None, help=argparse.SUPPRESS)
    return parser
