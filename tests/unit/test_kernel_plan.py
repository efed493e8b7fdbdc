"""engine.kernels.plan_store: a restart installs the stored plan without timing; retune times."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from engine.kernels.plan_store import choose_kernels, plan_dirs
from engine.kernels.rows import load_rows_gemm
from engine.layers.linear import Linear
from server.config import ServerConfig

SHAPES = [(64, 96), (64, 96), (96, 40)]  # (in, out), forward order


def model(seed: int, shapes: list[tuple[int, int]] = SHAPES) -> list[Linear]:
    """A model's CPU float32 linears, freshly built (default kernels) with weights of `seed`."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for k, n in shapes:
        layer = Linear(k, n, bias=n == 40, dtype=torch.float32, device="cpu")
        layer.load_rows(0, torch.randn(n, k, generator=g))
        if layer.bias is not None:
            layer.load_bias(0, torch.randn(n, generator=g))
        layers.append(layer)
    return layers


def check(layers: list[Linear]) -> None:
    """Each installed kernel against float64, at row counts of every bucket and above them."""
    for layer in layers:
        for m in (1, 3, 8, 64, 65, 200):
            x = torch.randn(m, layer.in_features)
            ref = x.double() @ layer.weight_view().double().t()
            if layer.bias is not None:
                ref += layer.bias.double()
            torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-4)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "home"


def prefetch_modes() -> dict[int, str]:
    lib = load_rows_gemm()
    return {} if lib is None else {r: lib.prefetch(r) for r in range(2, lib.max_rows + 1)}


def test_a_restart_reuses_the_stored_plan_without_timing(home: Path) -> None:
    first = model(0)
    timed = choose_kernels(first)
    assert timed.source == "timed" and timed.timings
    path = Path(timed.plan_path)
    assert path.parent == home / "kernels" / "plans" and path.is_file()
    stored, modes = path.read_bytes(), prefetch_modes()
    lib = load_rows_gemm()
    if lib is not None and modes:  # a later tuning in this process must not leak into the reuse
        lib.set_prefetch("nta" if modes[2] != "nta" else "none", 2)

    second = model(1)  # a restart: new layers (default kernels), other weights, same shapes
    reused = choose_kernels(second)
    assert reused.source == "stored" and reused.plan_path == str(path)
    assert reused.timings == [] and reused.passes == {} and reused.rows_prefetch == {}
    assert reused.chosen == timed.chosen
    assert [ly.kernel_names for ly in second] == [ly.kernel_names for ly in first]
    assert prefetch_modes() == modes
    assert path.read_bytes() == stored  # read, not written again
    check(second)


def test_retune_times_again_and_replaces_the_plan(home: Path) -> None:
    path = Path(choose_kernels(model(0)).plan_path)
    content = json.loads(path.read_text())
    content["chosen"] = {
        shape: dict.fromkeys(plan, "torch") for shape, plan in content["chosen"].items()
    }
    path.write_text(json.dumps(content))  # a plan that timing does not choose on this CPU
    reused = choose_kernels(model(1))
    assert reused.source == "stored"
    assert {name for plan in reused.chosen.values() for name in plan.values()} == {"torch"}
    layers = model(2)
    table = choose_kernels(layers, "retune")
    assert table.source == "timed" and table.timings and table.plan_path == str(path)
    stored = json.loads(path.read_text())["chosen"]
    assert stored == {
        f"{k}x{n}": {str(m): name for m, name in plan.items()}
        for (k, n), plan in table.chosen.items()
    }
    check(layers)


def test_plans_are_keyed_by_the_layers_and_threads(home: Path) -> None:
    a = choose_kernels(model(0)).plan_path
    b = choose_kernels(model(0, SHAPES[:2])).plan_path
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c = choose_kernels(model(0)).plan_path
    finally:
        torch.set_num_threads(threads)
    assert a != b
    if threads > 1:
        assert c not in (a, b)


def test_unwritable_home_falls_back_to_the_temp_folder(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "file" / "home"))  # cannot be made
    timed = choose_kernels(model(0))
    fallback = tmp_path / "tmp" / "specserve-kernel-plans"
    assert Path(timed.plan_path).parent == plan_dirs()[1] == fallback
    reused = choose_kernels(model(1))
    assert reused.source == "stored" and reused.chosen == timed.chosen


def test_a_plan_naming_an_unknown_kernel_is_timed_again(home: Path) -> None:
    path = Path(choose_kernels(model(0)).plan_path)
    content = json.loads(path.read_text())
    content["chosen"]["64x96"]["1"] = "gone"
    path.write_text(json.dumps(content))
    layers = model(1)
    table = choose_kernels(layers)
    assert table.source == "timed"
    assert "gone" not in json.loads(path.read_text())["chosen"]["64x96"].values()
    check(layers)


def test_kernel_plan_setting() -> None:
    """KERNEL_PLAN is a declared setting: its value reaches the engine's config, others stop
    start-up naming the values allowed."""
    assert ServerConfig.from_env_and_args([], {}).kernel_plan == "reuse"
    assert ServerConfig.from_env_and_args([], {"KERNEL_PLAN": "retune"}).kernel_plan == "retune"
    with pytest.raises(ValueError, match="reuse, retune"):
        ServerConfig.from_env_and_args([], {"KERNEL_PLAN": "again"})
