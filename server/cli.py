"""ServerConfig from env vars and flags: the one place the environment is read.

Each field is settable as env var `NAME` (or the aliases its metadata lists) or flag `--name`,
the flag winning (TGIS launcher semantics, tgis-interface.md §3.1). Boolean switches follow
clap's "flag + env" rule: any env value other than n/no/f/false/off/0 (or empty) enables them.

Every TGIS launcher flag is accepted: those without an equivalent here (`IGNORED_LAUNCHER_FLAGS`)
are parsed and reported by `parse_launcher` as warnings, so that none stops start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn

from server.config import ServerConfig

_FALSE_WORDS = frozenset({"", "n", "no", "f", "false", "off", "0"})

IGNORED_LAUNCHER_FLAGS = {
    "--deployment-framework": "the engine is specserve's own (paged attention, continuous "
    "batching)",
    "--quantize": "weights load unquantized, in DTYPE_STR",
    "--shard-uds-path": "shard processes meet over torch.distributed at MASTER_ADDR:MASTER_PORT",
    "--max-waiting-tokens": "waiting requests join the running batch at every step",
    "--max-prefill-padding": "batches are not padded",
    "--batch-safety-margin": "the KV pool is sized by CUDA_PROCESS_MEMORY_FRACTION, "
    "KV_CACHE_MEMORY_MB or KV_CACHE_BLOCKS",
    "--max-batch-weight": "obsolete in TGIS too; admission counts KV blocks",
    "--max-prefill-weight": "obsolete in TGIS too; long prompts prefill in chunks of "
    "MAX_BATCHED_TOKENS",
}
"""TGIS launcher flags (tgis-interface.md §3.1) that are accepted, with their env vars, and have
no effect here: flag -> why. `parse_launcher` reports each one given."""

TERMINATION_LOG_ENV = "TERMINATION_LOG_PATH"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class Launch:
    """The parsed command line: the config, and a warning per setting that has no effect."""

    config: ServerConfig
    warnings: tuple[str, ...] = ()


class _Parser(argparse.ArgumentParser):
    """Raises ValueError on a command-line error (instead of printing usage and exiting 2), so
    that the caller reports it like any invalid setting; --help still exits 0."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def config_from_env_and_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """See `ServerConfig.from_env_and_args`."""
    return parse_launcher(argv, env).config


def parse_launcher(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> Launch:
    """The ServerConfig of `env` (default os.environ) and `argv` (default sys.argv[1:]), and a
    warning for each TGIS setting given that has no effect here (an ignored launcher flag or its
    env var, DTYPE_STR=int8). ValueError for unknown flags and unparsable or invalid values."""
    env = os.environ if env is None else env
    args = build_arg_parser().parse_args(argv)
    warnings: list[str] = []
    values: dict[str, Any] = {}
    for f in fields(ServerConfig):
        env_names = f.metadata["env"] or (f.name.upper(),)
        flag_value = getattr(args, f.name)
        if flag_value is not None:
            source = f"--{f.name.replace('_', '-')}"
            values[f.name] = _parse(f, flag_value, source, warnings)
            continue
        set_envs = [(n, env[n]) for n in env_names if n in env]
        parsed = {
            n: _parse(f, v, n, warnings) for n, v in set_envs if v != "" or f.metadata["switch"]
        }
        if len(set(parsed.values())) > 1:
            raise ValueError(f"{f.name}: conflicting values {parsed}")
        if parsed:
            values[f.name] = next(iter(parsed.values()))
    for flag, reason in IGNORED_LAUNCHER_FLAGS.items():
        given = getattr(args, _ignored_dest(flag))
        var = flag[2:].replace("-", "_").upper()
        if given is None and env.get(var, "").strip():
            given = env[var]
        if given is not None:
            warnings.append(f"{var}={given} ({flag}) is ignored: {reason}")
    return Launch(ServerConfig(**values), tuple(dict.fromkeys(warnings)))


def _ignored_dest(flag: str) -> str:
    return f"ignored_{flag[2:].replace('-', '_')}"


def _parse(f: dataclasses.Field[Any], raw: str | bool, source: str, warnings: list[str]) -> Any:
    if isinstance(raw, bool):
        return raw
    kind = str(f.type)
    try:
        if f.metadata["parse"] is not None:
            value = f.metadata["parse"](raw)
            if value is None and f.name == "dtype":  # int8: see canonical_dtype
                warnings.append(
                    f"{source}={raw} is ignored: 8-bit (bitsandbytes) weights are not supported; "
                    "weights load in the default dtype"
                )
            return value
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
    """The CLI: one flag per ServerConfig field, help text from the field's docstring, plus the
    TGIS launcher flags that are accepted without effect."""
    parser = _Parser(
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
    ignored = parser.add_argument_group("TGIS launcher flags accepted without effect")
    for flag, reason in IGNORED_LAUNCHER_FLAGS.items():
        env_name = flag[2:].replace("-", "_").upper()
        ignored.add_argument(
            flag,
            dest=_ignored_dest(flag),
            metavar=env_name,
            default=None,
            help=f"Ignored (a warning is logged): {reason}. [env: {env_name}]",
        )
    return parser


def json_output_requested(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> bool:
    """Whether JSON_OUTPUT / --json-output is on, read before the rest of the configuration so
    that its errors are logged in the requested format."""
    env = os.environ if env is None else env
    args = sys.argv[1:] if argv is None else argv
    if "--json-output" in args:
        return True
    return env.get("JSON_OUTPUT", "").strip().lower() not in _FALSE_WORDS


def termination_log_path(env: Mapping[str, str] | None = None) -> tuple[str | None, bool]:
    """Where a fatal error's message is written (Kubernetes' terminationMessagePath), and whether
    to create that file: TERMINATION_LOG_PATH (created if missing; empty: nowhere), else
    /dev/termination-log when it exists (the kubelet mounts it)."""
    env = os.environ if env is None else env
    if TERMINATION_LOG_ENV in env:
        return env[TERMINATION_LOG_ENV] or None, True
    return DEFAULT_TERMINATION_LOG, False
