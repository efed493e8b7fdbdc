"""A setting declared once, as a `Setting` in its dataclass field's metadata, and everything
made from that declaration: the env + flag parser, `--help` and docs/configuration.md's
table. A setting's range is declared with it, as the engine declares its fields' (`Bounds`,
checked by `engine.config.check_bounds`).

TGIS's launcher semantics (clap's "arg + env"): each setting is settable as env var `NAME` (or
the aliases it declares) or flag `--name` (lower case, dashes, plus the short flags it
declares), the flag winning. An empty env var counts as unset, except for a switch, which any
env value other than n/no/f/false/off/0 (or empty) turns on. Aliases set to different values are
an error. dataclasses + argparse rather than a settings library: no new runtime dependency, and
these rules (and the error messages tests and deployments rely on) stay exactly TGIS's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, NoReturn

from engine.config import Bounds, bounded

FALSE_WORDS = frozenset({"", "n", "no", "f", "false", "off", "0"})
"""Env values that leave a switch off."""


def parse_bool(raw: str) -> bool:
    """true/false (or 1/0, yes/no, y/n, on/off, t/f), any case."""
    word = raw.strip().lower()
    if word in ("true", "1", "yes", "y", "on", "t"):
        return True
    if word in ("false", "0", "no", "n", "off", "f"):
        return False
    raise ValueError("expected true or false")


def parse_switch(raw: str) -> bool:
    """A switch's env value: on unless one of `FALSE_WORDS`."""
    return raw.strip().lower() not in FALSE_WORDS


def parse_int_list(raw: str) -> tuple[int, ...] | None:
    """A comma list of integers ("5,3,2"); None when blank."""
    if not raw.strip():
        return None
    try:
        return tuple(int(v) for v in raw.replace(" ", "").split(","))
    except ValueError:
        raise ValueError("expected a comma list of integers") from None


@dataclass(frozen=True)
class Kind:
    """A setting's type: how its raw string (env value or flag argument) becomes its value
    (`parse`, ValueError when it cannot), and how that type reads in help (`name`)."""

    name: str
    parse: Callable[[str], Any]


TEXT = Kind("text", str)
INTEGER = Kind("integer", int)
NUMBER = Kind("number", float)
BOOLEAN = Kind("true/false", parse_bool)
SWITCH = Kind("switch", parse_switch)
"""A flag without argument; as an env var, on unless false (see `FALSE_WORDS`)."""
INT_LIST = Kind("comma list of integers", parse_int_list)


@dataclass(frozen=True)
class Setting:
    """One setting's declaration (beyond its field's name, type annotation and default)."""

    help: str
    kind: Kind
    env: tuple[str, ...] = ()
    """Env var names, TGIS's own first, then its aliases; default: the field name upper case."""
    flags: tuple[str, ...] = ()
    """Flags besides `--field-name`, e.g. a short one."""
    default_help: str | None = None
    """How the default reads in help, where the default value alone would not say it."""
    ignored_because: str | None = None
    """Why a value that `kind` parses to None is accepted but has no effect (a warning)."""


def setting(
    default: Any,
    help: str,
    kind: Kind,
    *,
    env: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    bounds: Bounds | None = None,
    default_help: str | None = None,
    ignored_because: str | None = None,
) -> Any:
    """A dataclass field declaring a setting: its default (a callable: a default factory, for a
    default that depends on the environment), its `Setting`, and its `bounds` (the values
    accepted, as the engine declares its own: `engine.config.check_bounds` checks them)."""
    metadata: dict[str, Any] = {
        "setting": Setting(help, kind, env, flags, default_help, ignored_because),
        **({} if bounds is None else bounded(bounds)),
    }
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Declared:
    """A declared setting with its field: the names it is set by and its default, resolved."""

    field: Field[Any]
    setting: Setting

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def env(self) -> tuple[str, ...]:
        return self.setting.env or (self.name.upper(),)

    @property
    def flags(self) -> tuple[str, ...]:
        return (f"--{self.name.replace('_', '-')}", *self.setting.flags)

    @property
    def default_text(self) -> str:
        if self.setting.default_help is not None:
            return self.setting.default_help
        default = self.field.default
        if default is None or default is MISSING:
            return "unset"
        if isinstance(default, bool):
            return str(default).lower()
        return str(default)

    @property
    def bounds(self) -> Bounds | None:
        bounds: Bounds | None = self.field.metadata.get("bounds")
        return bounds

    @property
    def values_text(self) -> str:
        """The kind, and the bounds where declared: "integer >= 1"."""
        bounds = self.bounds
        if bounds is None:
            return self.setting.kind.name
        if bounds.choices:
            return bounds.range
        return f"{self.setting.kind.name}{', each' if bounds.each else ''} {bounds.range}"


def declared(config_class: type) -> tuple[Declared, ...]:
    """The settings of the dataclass `config_class`, in field order."""
    return tuple(Declared(f, f.metadata["setting"]) for f in fields(config_class))


class _Parser(argparse.ArgumentParser):
    """Raises ValueError on a command-line error (instead of printing usage and exiting 2), so
    that the caller reports it like any invalid setting; --help still exits 0."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _ignored_dest(flag: str) -> str:
    return f"ignored_{flag[2:].replace('-', '_')}"


def _env_of(flag: str) -> str:
    return flag[2:].replace("-", "_").upper()


def build_parser(
    config_class: type, ignored_flags: Mapping[str, str], prog: str, description: str
) -> argparse.ArgumentParser:
    """The CLI: the declared settings' flags, with help from their declarations, and the flags
    accepted without effect (`ignored_flags`: flag -> why)."""
    parser = _Parser(prog=prog, description=description)
    for d in declared(config_class):
        help_text = (
            f"{d.setting.help} ({d.values_text}; default: {d.default_text}) "
            f"[env: {', '.join(d.env)}]"
        ).replace("%", "%%")
        if d.setting.kind is SWITCH:
            parser.add_argument(
                *d.flags,
                dest=d.name,
                action="store_const",
                const=True,
                default=None,
                help=help_text,
            )
        else:
            metavar = d.env[0] if d.setting.kind is not BOOLEAN else "{true,false}"
            parser.add_argument(*d.flags, dest=d.name, metavar=metavar, help=help_text)
    ignored = parser.add_argument_group("TGIS launcher flags accepted without effect")
    for flag, reason in ignored_flags.items():
        ignored.add_argument(
            flag,
            dest=_ignored_dest(flag),
            metavar=_env_of(flag),
            help=f"Ignored (a warning is logged): {reason}. [env: {_env_of(flag)}]",
        )
    return parser


def read_settings(
    parser: argparse.ArgumentParser,
    config_class: type,
    ignored_flags: Mapping[str, str],
    argv: Sequence[str] | None,
    env: Mapping[str, str],
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The values of `config_class`'s settings given in `env` or as flags in `argv` (default
    sys.argv[1:]; a flag wins over its env vars), and a warning for each setting given that has
    no effect (an ignored flag or its env var, a value its `Setting.ignored_because` names).
    ValueError for unknown flags, unparsable values (naming the field, the value and where it
    came from) and aliases set to different values."""
    args = parser.parse_args(argv)
    warnings: list[str] = []
    values: dict[str, Any] = {}
    for d in declared(config_class):
        flag_value = getattr(args, d.name)
        if flag_value is not None:
            values[d.name] = _parse(d, flag_value, d.flags[0], warnings)
            continue
        switch = d.setting.kind is SWITCH
        given = [(n, env[n]) for n in d.env if n in env and (env[n] != "" or switch)]
        parsed = {n: _parse(d, v, n, warnings) for n, v in given}
        if len(set(parsed.values())) > 1:
            raise ValueError(f"{d.name}: conflicting values {parsed}")
        if parsed:
            values[d.name] = next(iter(parsed.values()))
    for flag, reason in ignored_flags.items():
        value = getattr(args, _ignored_dest(flag))
        var = _env_of(flag)
        if value is None and env.get(var, "").strip():
            value = env[var]
        if value is not None:
            warnings.append(f"{var}={value} ({flag}) is ignored: {reason}")
    return values, tuple(dict.fromkeys(warnings))


def _parse(d: Declared, raw: str | bool, source: str, warnings: list[str]) -> Any:
    if isinstance(raw, bool):  # a switch given as a flag
        return raw
    try:
        value = d.setting.kind.parse(raw)
    except ValueError as e:
        raise ValueError(f"{d.name}: invalid value {raw!r} from {source}: {e}") from None
    if value is None and d.setting.ignored_because is not None and raw.strip():
        warnings.append(f"{source}={raw} is ignored: {d.setting.ignored_because}")
    return value


def markdown_table(
    config_class: type,
    ignored_flags: Mapping[str, str],
    extra_rows: Sequence[tuple[str, str, str]] = (),
) -> str:
    """The settings of `config_class` as a Markdown table (env vars, flags, values, default,
    meaning), then `extra_rows` (env var, default, meaning) of variables read elsewhere, then
    the flags accepted without effect."""
    lines = [
        "| env var | flag | values | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for d in declared(config_class):
        default = d.default_text
        if d.setting.default_help is None and default != "unset":
            default = f"`{default}`"
        cells = (
            " / ".join(f"`{e}`" for e in d.env),
            ", ".join(f"`{f}`" for f in d.flags),
            d.values_text,
            default,
            d.setting.help,
        )
        lines.append(_row(cells))
    for name, default, meaning in extra_rows:
        lines.append(_row((f"`{name}`", "", "", default, meaning)))
    for flag, reason in ignored_flags.items():
        meaning = f"Accepted without effect (a warning is logged): {reason}."
        lines.append(_row((f"`{_env_of(flag)}`", f"`{flag}`", "ignored", "", meaning)))
    return "\n".join(lines) + "\n"


def _row(cells: Sequence[str]) -> str:
    """A table row; the cells' | and < escaped, so that none ends a cell or opens an HTML tag."""
    escaped = (c.replace("|", "\\|").replace("<", "\\<") for c in cells)
    return "| " + " | ".join(escaped) + " |"
