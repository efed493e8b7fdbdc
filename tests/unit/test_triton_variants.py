"""No Triton compile after start-up: every attention launch of a serving run needs a kernel
variant that the backend's start-up warm-up already made.

How it is checked: a compiled Triton kernel looks each launch up in its cache by a key that
`JITFunction.run` builds with a binder from `triton.runtime.jit.create_function_from_signature`
(over the kernel's parameters, marked `do_not_specialize` / `do_not_specialize_on_alignment` as
`JITFunction.__init__` marks them) and `compute_cache_key`. The binder specializes each argument
through the backend's `native_specialize_impl`: tensors by dtype and 16-byte alignment, integers
by type and by being 1 or divisible by 16, constexprs by value. The interpreter has no such
cache, so `variant_key` calls those same functions of the installed Triton, with the CUDA
backend, on the arguments of every launch, which the test observes by wrapping each kernel's
`run` (the kernel still runs). With `TRITON_INTERPRET=0` on CUDA it also checks that Triton's
own compile cache does not grow while serving.

The run starts a model runner (its warm-up launches are the reference set) and serves prompts of
different lengths with speculation: prefill chunks, decode rows, draft trees, CUDA-graph steps
of several buckets and eager steps, through a backend that splits the keys of small grids, so
that split launches of several split counts occur too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import KernelParam, compute_cache_key, create_function_from_signature

from engine.attention import triton_kernels
from engine.attention.triton_backend import BLOCK_N, TritonBackend
from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.model_runner import ModelRunner
from engine.paths import model_path
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter
from tests.unit.test_triton_attention import DEVICE, INTERPRETED
from tools.scripted_proposer import ScriptedProposer

KERNELS = {
    "paged_attention": triton_kernels.paged_attention_kernel,
    "merge_splits": triton_kernels.merge_splits_kernel,
}
SPECIALIZER = CUDABackend(GPUTarget("cuda", 90, 32))

Launch = tuple[str, tuple[Any, ...], dict[str, Any]]


def variant_key(
    kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], honour_lists: bool = True
) -> str:
    """The compile-cache key Triton's `JITFunction` computes for this launch; with
    `honour_lists` False, as if the kernel declared no `do_not_specialize*` lists."""
    signature = inspect.signature(kernel.fn)
    options = getattr(kernel, "kwargs", None)  # the interpreter keeps jit's keyword arguments
    if options is None:  # a compiled JITFunction
        options = {
            "do_not_specialize": kernel.do_not_specialize,
            "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment,
        }
    dns = (options.get("do_not_specialize") or []) if honour_lists else []
    dnsa = (options.get("do_not_specialize_on_alignment") or []) if honour_lists else []
    params = [
        KernelParam(i, p, i in dns or p.name in dns, i in dnsa or p.name in dnsa)
        for i, p in enumerate(signature.parameters.values())
    ]
    binder = create_function_from_signature(signature, params, SPECIALIZER)
    _, specialization, launch_options = binder(*args, **kwargs)
    key: str = compute_cache_key({}, specialization, launch_options)
    return key


def _recording(name: str, run: Callable[..., Any], launches: list[Launch]) -> Callable[..., Any]:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        options = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        launches.append((name, args, options))
        return run(*args, **kwargs)

    return recorded


@contextmanager
def recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Launch]]:
    """Every launch of the attention kernels while the block runs."""
    launches: list[Launch] = []
    with monkeypatch.context() as patch:
        for name, kernel in KERNELS.items():
            patch.setattr(kernel, "run", _recording(name, kernel.run, launches))
        yield launches


def compiled_variants() -> dict[str, int]:
    """How many variants of each kernel Triton has compiled on CUDA (none in the interpreter)."""
    if INTERPRETED:
        return {}
    return {
        name: sum(len(caches[0]) for caches in kernel.device_caches.values())
        for name, kernel in KERNELS.items()
    }


def keys(launches: list[Launch], honour_lists: bool = True) -> set[tuple[str, str]]:
    return {(n, variant_key(KERNELS[n], a, k, honour_lists)) for n, a, k in launches}


def serve(runner: ModelRunner) -> None:
    """Three requests of different lengths with two-candidate draft trees: prefill, decode and
    tree rows, one to three sequences per step."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((70, 41, 9))]
    truths = [p + [0] * 32 for p in prompts]  # the drafts are partly wrong: trees get rejected
    proposer = ScriptedProposer(truths, [2, 0, 3, 1], 3, n_candidates=2, vocab_size=49152)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128)
    engine = LLMEngine(runner, config, frozenset(), Drafter(proposer, None, max_batch_size=4))
    for i, (prompt, n) in enumerate(zip(prompts, (8, 4, 10), strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=n))
    while engine.has_unfinished_requests():
        engine.step()


def test_serving_needs_no_variant_the_warm_up_did_not_make(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = TritonBackend(4, num_sms=8, min_split_keys=BLOCK_N)
    monkeypatch.setattr("engine.model_runner.select_backend", lambda *args: backend)
    config = EngineConfig(
        model_path("tiny-llama-gqa-tied"),
        device=DEVICE,
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=128,
        cpu_kernels=False,
        cuda_graph_max_rows=16,
    )
    with recorded_launches(monkeypatch) as start_up:
        runner = ModelRunner(config)
    assert runner.graphs is not None  # graph steps run eagerly off CUDA, on static buffers
    warm = keys(start_up)
    assert {name for name, _ in warm} == set(KERNELS)
    assert len(warm) == 3  # unsplit, split and merge: one cache alignment

    compiled = compiled_variants()
    with recorded_launches(monkeypatch) as serving:
        serve(runner)
    assert compiled_variants() == compiled  # on CUDA: Triton's own cache did not grow
    paged = [a for n, a, _ in serving if n == "paged_attention"]
    if INTERPRETED:  # on CUDA graph steps replay without launching through Triton
        # What varies between launches (see triton_kernels.py): the batch's sequences, the
        # block table's width and the alignment of the step buffer's slices; split counts.
        assert len({a[12] for a in paged}) >= 3  # num_seqs
        assert {w % 16 == 0 for w in {a[22] for a in paged}} == {True, False}  # table stride
        assert len({a[8].data_ptr() % 16 for a in paged}) >= 2  # seq_lens slices
        assert {a[13] for a in paged} == {1, 2, 4}  # num_splits
    assert keys(serving) <= warm

    # The same launches with every argument specialized need variants the warm-up did not make:
    # the run above would compile while serving without the kernels' do_not_specialize lists.
    assert not keys(serving, honour_lists=False) <= keys(start_up, honour_lists=False)


def test_variant_key_sees_what_stays_specialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is not blind: the output's alignment, a cache stride's divisibility and the
    constexprs change it; the batch's integers and the step buffer's alignment do not."""
    cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    with recorded_launches(monkeypatch) as launches:
        TritonBackend(4).warm_up([(cache, cache)], 4)
    name, args, kwargs = launches[0]
    kernel = KERNELS[name]
    key = variant_key(kernel, args, kwargs)

    def changed(i: int, value: Any) -> str:
        return variant_key(kernel, (*args[:i], value, *args[i + 1 :]), kwargs)

    def misaligned(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)

    assert changed(0, misaligned(args[0])) != key  # output 4 bytes off 16
    assert changed(19, 17) != key  # cache block stride not a multiple of 16
    assert variant_key(kernel, args, {**kwargs, "SPLIT": True}) != key
    assert changed(12, 1) == changed(12, 32) == key  # num_seqs
    assert changed(22, 1) == changed(22, 7) == key  # block table stride
    aligned_seq_lens = (*args[:8], torch.zeros_like(args[8]), *args[9:])
    assert args[8].data_ptr() % 16 != 0  # prepare's slice of one sequence's buffer
    assert variant_key(kernel, aligned_seq_lens, kwargs) == key
    assert variant_key(kernel, aligned_seq_lens, kwargs, honour_lists=False) != variant_key(
        kernel, args, kwargs, honour_lists=False
    )
