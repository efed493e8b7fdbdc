"""The launcher's command line and environment: the `ServerConfig` of env vars and flags with
the warnings of settings that have no effect, what is read before it (JSON logs, the
termination log), and the configuration table of docs/configuration.md (`python -m server.cli
--markdown-table`).

Every TGIS launcher flag is accepted: those without an equivalent here
(`server.config.IGNORED_LAUNCHER_FLAGS`) are parsed and reported by `parse_launcher` as
warnings, so that none stops start-up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from server.config import IGNORED_LAUNCHER_FLAGS, ServerConfig, arg_parser
from server.setting import declared, markdown_table, parse_switch, read_settings

TERMINATION_LOG_ENV = "TERMINATION_LOG_PATH"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
LOG_LEVEL_ENV = "LOG_LEVEL"
DEFAULT_LOG_LEVEL = "INFO"

OTHER_ENV_VARS = (
    (
        "HF_HUB_CACHE",
        "$HF_HOME/hub, else ~/.cache/huggingface/hub",
        "The Hugging Face cache searched for Hub ids; TRANSFORMERS_CACHE and "
        "HUGGINGFACE_HUB_CACHE are accepted too (TGIS's order).",
    ),
    (LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL, "Python log level."),
    (
        TERMINATION_LOG_ENV,
        f"{DEFAULT_TERMINATION_LOG} when it exists",
        "File that receives a fatal error's message (Kubernetes' terminationMessagePath), as "
        "TGIS writes its panics there; created if set; empty: none.",
    ),
    (
        "SPECSERVE_HOME",
        "~/.cache/specserve",
        "Prepared models (models/) and speculators (speculators/).",
    ),
)
"""Env vars read outside `ServerConfig` (by the launcher, logging and `engine.paths`): name,
default and meaning, for the configuration table."""


@dataclass(frozen=True)
class Launch:
    """The parsed command line: the config, and a warning per setting that has no effect."""

    config: ServerConfig
    warnings: tuple[str, ...] = ()


def parse_launcher(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> Launch:
    """The ServerConfig of `env` (default os.environ) and `argv` (default sys.argv[1:]), and a
    warning for each TGIS setting given that has no effect here (an ignored launcher flag or its
    env var, DTYPE_STR=int8). ValueError for unknown flags and unparsable or invalid values."""
    env = os.environ if env is None else env
    values, warnings = read_settings(arg_parser(), ServerConfig, IGNORED_LAUNCHER_FLAGS, argv, env)
    return Launch(ServerConfig(**values), warnings)


def json_output_requested(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> bool:
    """Whether JSON_OUTPUT / --json-output is on, read before the rest of the configuration so
    that its errors are logged in the requested format."""
    env = os.environ if env is None else env
    args = sys.argv[1:] if argv is None else argv
    (json_output,) = (d for d in declared(ServerConfig) if d.name == "json_output")
    if any(flag in args for flag in json_output.flags):
        return True
    return any(parse_switch(env[name]) for name in json_output.env if name in env)


def log_level(env: Mapping[str, str] | None = None) -> str:
    """LOG_LEVEL, default INFO."""
    env = os.environ if env is None else env
    return env.get(LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL)


def termination_log_path(env: Mapping[str, str] | None = None) -> tuple[str | None, bool]:
    """Where a fatal error's message is written (Kubernetes' terminationMessagePath), and whether
    to create that file: TERMINATION_LOG_PATH (created if missing; empty: nowhere), else
    /dev/termination-log when it exists (the kubelet mounts it)."""
    env = os.environ if env is None else env
    if TERMINATION_LOG_ENV in env:
        return env[TERMINATION_LOG_ENV] or None, True
    return DEFAULT_TERMINATION_LOG, False


def configuration_table() -> str:
    """docs/configuration.md's table: every setting of `ServerConfig`, the env vars read
    outside it, and the TGIS launcher flags accepted without effect."""
    return markdown_table(ServerConfig, IGNORED_LAUNCHER_FLAGS, OTHER_ENV_VARS)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown-table"]:
        sys.exit("usage: python -m server.cli --markdown-table")
    sys.stdout.write(configuration_table())
