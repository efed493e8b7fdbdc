"""Every setting is declared once (`server.setting.Setting` on a ServerConfig field) and that one
declaration reaches `--help`, docs/configuration.md's table and the start-up checks: checked here
on the real declaration, setting by setting, and on a setting added in a subclass."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass
from pathlib import Path

import pytest

from engine.config import Bounds, EngineConfig
from engine.cuda_graphs import MAX_TREE_ROWS, ROW_COUNTS
from server.cli import configuration_table, parse_launcher
from server.config import IGNORED_LAUNCHER_FLAGS, ServerConfig, arg_parser
from server.setting import (
    INTEGER,
    NUMBER,
    Declared,
    build_parser,
    declared,
    markdown_table,
    read_settings,
    setting,
)

TABLE_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SETTINGS = declared(ServerConfig)
BOUNDED = [d for d in SETTINGS if d.bounds is not None]


def _doc_table() -> str:
    text = TABLE_DOC.read_text()
    match = re.search(r"^<!-- configuration table:.*?-->\n(.*?)^<!-- end of", text, re.M | re.S)
    assert match, "docs/configuration.md has no configuration table markers"
    return match.group(1)


def test_documented_table_is_the_generated_one() -> None:
    """Regenerate with `python -m server.cli --markdown-table` when this fails."""
    assert _doc_table() == configuration_table()


@pytest.mark.parametrize("d", SETTINGS, ids=lambda d: d.name)
def test_setting_is_in_help_and_table(d: Declared) -> None:
    help_text = " ".join(arg_parser().format_help().split())
    for flag in d.flags:
        assert re.search(rf"(^|[\s,]){re.escape(flag)}\b", help_text), flag
    assert f"[env: {', '.join(d.env)}]" in help_text
    assert d.values_text in help_text
    (row,) = [line for line in _doc_table().splitlines() if f"`{d.flags[0]}`" in line]
    assert row.startswith(f"| {' / '.join(f'`{e}`' for e in d.env)} |")
    assert f"| {d.values_text} |" in row


@pytest.mark.parametrize("d", SETTINGS, ids=lambda d: d.name)
def test_default_reads_back_through_its_kind(d: Declared) -> None:
    """The declared kind parses the default's own text back to the default (so the type and
    the default agree), and the default is within the declared bounds."""
    default = d.field.default
    if default is None or default is MISSING:
        return
    text = str(default).lower() if isinstance(default, bool) else str(default)
    parsed = d.setting.kind.parse(text)
    assert parsed == default and type(parsed) is type(default)
    assert d.bounds is None or d.bounds.holds(default)


def _outside(bounds: Bounds, kind_is_number: bool) -> str:
    """A raw value just outside `bounds`."""
    if bounds.choices:
        return "no-such-choice"
    if bounds.low is not None:
        value = bounds.low if bounds.low_open else bounds.low - (0.5 if kind_is_number else 1)
    else:
        assert bounds.high is not None
        value = bounds.high + 1
    return f"{value},{value}" if bounds.each else str(value)


def _inside(bounds: Bounds) -> str:
    """A raw value at the edge of `bounds` (or in it, next to an excluded edge)."""
    if bounds.choices:
        return bounds.choices[-1]
    if bounds.low is None:
        assert bounds.high is not None
        value = bounds.high
    else:
        value = bounds.low + 0.5 if bounds.low_open else bounds.low
    return f"{value},{value}" if bounds.each else str(value)


@pytest.mark.parametrize("d", BOUNDED, ids=lambda d: d.name)
def test_bounds_are_enforced_from_env_and_flag(d: Declared) -> None:
    bounds = d.bounds
    assert bounds is not None
    raw = _outside(bounds, d.setting.kind is NUMBER)
    value = d.setting.kind.parse(raw)
    for env, argv in (({d.env[-1]: raw}, []), ({}, [d.flags[-1], raw])):
        with pytest.raises(ValueError) as info:
            parse_launcher(argv, env)
        assert str(info.value) == f"{d.name} must be {bounds}, got {value!r}"
    base = {} if d.name == "max_batch_size" else {"MAX_BATCH_SIZE": "1"}
    ok = _inside(bounds)
    config = parse_launcher([], {**base, d.env[0]: ok}).config
    assert getattr(config, d.name) == d.setting.kind.parse(ok)
    if bounds.high is not None:  # the other edge too
        config = parse_launcher([], {**base, d.env[0]: str(bounds.high)}).config
        assert getattr(config, d.name) == d.setting.kind.parse(str(bounds.high))


def test_cuda_graphs_help_says_which_steps_replay() -> None:
    (d,) = [d for d in SETTINGS if d.name == "no_cuda_graphs"]
    counts = ", ".join(map(str, ROW_COUNTS[:-1])) + f" and {ROW_COUNTS[-1]} rows"
    assert counts in d.setting.help
    assert f"up to min({EngineConfig.cuda_graph_max_rows}, MAX_BATCHED_TOKENS) rows" in (
        d.setting.help
    )
    assert f"at most {MAX_TREE_ROWS} rows per sequence" in d.setting.help


@dataclass(frozen=True)
class Extended(ServerConfig):
    extra_knob: int = setting(3, "An extra knob.", INTEGER, env=("EXTRA_KNOB", "OLD_KNOB"))
    bounded_knob: float = setting(1.0, "A bounded knob.", NUMBER, bounds=Bounds(low=0.5, high=2))


def test_a_setting_added_in_one_place_is_everywhere() -> None:
    parser = build_parser(Extended, IGNORED_LAUNCHER_FLAGS, "x", "y")
    help_text = " ".join(parser.format_help().split())
    assert "--extra-knob" in help_text and "[env: EXTRA_KNOB, OLD_KNOB]" in help_text
    assert "number in [0.5, 2]" in help_text
    table = markdown_table(Extended, {})
    assert "| `EXTRA_KNOB` / `OLD_KNOB` | `--extra-knob` | integer | `3` | An extra knob. |" in (
        table
    )
    values, _ = read_settings(parser, Extended, {}, ["--extra-knob", "7"], {"OLD_KNOB": "5"})
    assert Extended(**values).extra_knob == 7
    values, _ = read_settings(parser, Extended, {}, [], {"OLD_KNOB": "5"})
    assert Extended(**values).extra_knob == 5
    with pytest.raises(ValueError, match="extra_knob: conflicting values"):
        read_settings(parser, Extended, {}, [], {"OLD_KNOB": "5", "EXTRA_KNOB": "6"})
    values, _ = read_settings(parser, Extended, {}, [], {"BOUNDED_KNOB": "2.5"})
    with pytest.raises(ValueError, match=r"^bounded_knob must be in \[0.5, 2\], got 2.5$"):
        Extended(**values)
    assert "bounded_knob" not in {d.name for d in SETTINGS}
