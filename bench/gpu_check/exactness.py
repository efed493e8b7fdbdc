"""Section `exactness`: greedy output of tiny random Llamas against transformers in float32
and float16, CUDA graphs against eager steps, speculation on against off.

On a GPU every runner uses the Triton backend and its CUDA-graph step. On CPU one case (the
first model in float32; three prompts, 8 new tokens, scripted drafts only) does the same, the
kernel in Triton's interpreter and the graph step's static buffers run eagerly, and the others
run on the CPU backend (without graphs). A case on the Triton backend counts the kernel
launches and graph steps it made (`*.triton_launches`, `*.graph_steps`), which must not be 0.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_check.models import (
    TINY_MODELS,
    Reference,
    hf_greedy,
    judge,
    prompt_ids,
    run_engine,
    write_tiny_llama,
)
from bench.gpu_check.reach import triton_and_graphs, triton_on_cpu
from bench.gpu_check.report import (
    EOS_ID,
    FP16_NEAR_TIE,
    FP32_NEAR_TIE,
    Ctx,
    free_device_memory,
    status,
)


def section_exactness(ctx: Ctx) -> None:
    import torch

    r = ctx.report
    max_new = 16 if ctx.small else 32
    # Several lengths: with a 64-token step budget (see `check_speculation`) the longer prompts
    # prefill in chunks while the shorter ones already verify draft trees.
    lengths = (5, 17, 40, 90, 150)
    for spec in TINY_MODELS:
        folder = ctx.tmp / spec.name
        hf = write_tiny_llama(folder, spec)
        prompts = prompt_ids(spec.vocab_size, lengths, spec.seed)
        for dtype_name, near_tie in (("float32", FP32_NEAR_TIE), ("float16", FP16_NEAR_TIE)):
            tag = f"exactness.{spec.name}.{dtype_name}"
            if ctx.left() < 10:
                r.check(f"{tag}.skipped", "time", "-", "INFO")
                continue
            # In place: float32 first, then float16.
            hf = hf.to(device=ctx.device, dtype=getattr(torch, dtype_name))
            triton = ctx.cuda or (spec == TINY_MODELS[0] and dtype_name == "float32")
            case = Case(tag, folder, dtype_name, prompts, [], near_tie, max_new, triton)
            if triton and not ctx.cuda:  # the interpreter is slow: a shorter run
                case.prompts, case.max_new = prompts[:3], 8
            backend = triton_on_cpu(ctx.device) if triton else contextlib.nullcontext()
            with backend, triton_and_graphs() as calls:
                ctx.step(tag, functools.partial(check_plain, ctx, case, hf), min_left=5)
                if case.llm is not None:
                    ctx.step(f"{tag}.spec", functools.partial(check_speculation, ctx, case), 5)
            if triton:
                launches = calls["triton_launches"]
                r.check(f"{tag}.triton_launches", launches, "launches", status(launches > 0))
            case.llm = None
            free_device_memory()
        del hf
        free_device_memory()


@dataclass
class Case:
    """One tiny model in one dtype, its prompts and transformers' greedy references."""

    tag: str
    folder: Path
    dtype_name: str
    prompts: list[list[int]]
    refs: list[Reference]
    near_tie: float
    max_new: int
    triton: bool  # on the Triton backend, with its graph step
    llm: Any = None


def check_plain(ctx: Ctx, case: Case, hf: Any) -> None:
    """`LLM.generate` (all prompts in one batch) against transformers, prompt by prompt; then
    the same runner without its graphs: the graph run against the eager one."""
    from engine import LLM

    r = ctx.report
    case.refs = [hf_greedy(hf, p, case.max_new, ctx.device) for p in case.prompts]
    llm = LLM(
        case.folder, dtype=case.dtype_name, device=ctx.device, max_num_tokens=4096,
        max_num_seqs=16, cpu_kernels=not case.triton,
    )  # fmt: skip
    case.llm = llm
    r.detail(f"{case.tag}.attention_backend", llm.runner.backend.name)
    with triton_and_graphs() as calls:
        outs = llm.generate(case.prompts, case.max_new)
    verdicts = [
        judge(o.token_ids, ref, case.near_tie) for o, ref in zip(outs, case.refs, strict=True)
    ]
    r.detail(f"{case.tag}.verdicts", verdicts)
    same = sum(v == "same" for v, _ in verdicts)
    flips = sum(v == "flip" for v, _ in verdicts)
    bad = [(i, gap) for i, (v, gap) in enumerate(verdicts) if v == "bad"]
    if bad:
        r.detail(f"{case.tag}.bad", bad)
    n = len(case.prompts)
    r.check(f"{case.tag}.identical", f"{same}/{n}", "prompts", status(not bad))
    r.check(f"{case.tag}.near_tie_flips", flips, "prompts", "INFO")
    graphs = llm.runner.graphs
    if graphs is None:  # a failure where the Triton backend should have made them
        r.check(f"{case.tag}.graphs_vs_eager", "no_graphs", "-", "FAIL" if case.triton else "INFO")
        return
    steps = calls["graph_steps"]
    r.check(f"{case.tag}.graph_steps", steps, "steps", status(steps > 0))
    llm.runner.graphs = None
    try:
        eager = llm.generate(case.prompts, case.max_new, return_logits=True)
    finally:
        llm.runner.graphs = graphs
    pairs = [
        judge(o.token_ids, Reference(e.token_ids, e.logits), case.near_tie)
        for o, e in zip(outs, eager, strict=True)
    ]
    r.detail(f"{case.tag}.graphs_vs_eager", pairs)
    equal = sum(v == "same" for v, _ in pairs)
    ok = all(v != "bad" for v, _ in pairs)
    r.check(f"{case.tag}.graphs_vs_eager", f"{equal}/{n}", "prompts", status(ok))


def check_speculation(ctx: Ctx, case: Case) -> None:
    """Speculation on against off in the same runner: a random MLP speculator ([5,3,2]x5
    trees, nearly all drafts rejected) and scripted drafts of the known greedy continuation
    with wrong branches (many accepted). A difference must be a near-tie in transformers'
    logits, as for `check_plain`."""
    from engine.config import SchedulerConfig
    from engine.core import LLMEngine
    from engine.spec_decode.drafter import Drafter
    from engine.spec_decode.loader import load_speculator
    from engine.spec_decode.proposer import MLPProposer
    from tools.scripted_proposer import ScriptedProposer
    from tools.tiny_speculator import write_tiny_speculator

    r = ctx.report
    runner = case.llm.runner
    eos = frozenset({EOS_ID})
    # A small step budget: the 90- and 150-token prompts prefill in chunks while the short
    # ones already decode with draft trees, in the same steps.
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=2048)
    off, _, _ = run_engine(LLMEngine(runner, sched, eos), case.prompts, case.max_new)
    spec_dir = write_tiny_speculator(
        ctx.tmp / f"spec-{case.folder.name}", case.folder, n_predict=3, inner_dim=64,
        top_k_tokens_per_head=(5, 3, 2), n_candidates=5, seed=3,
    )  # fmt: skip
    speculator = load_speculator(
        spec_dir, hidden_size=runner.config.hidden_size, vocab_size=runner.config.vocab_size,
        dtype=runner.dtype, device=ctx.device,
    )  # fmt: skip
    proposers: dict[str, Any] = {
        "random_speculator": MLPProposer(speculator, (5, 3, 2), 5),
        "scripted": ScriptedProposer(
            [p + o for p, o in zip(case.prompts, off, strict=True)], (4, 0, 2, 1, 3, 4),
            num_heads=4, n_candidates=3, vocab_size=runner.config.vocab_size,
        ),
    }  # fmt: skip
    if case.triton and not ctx.cuda:  # in the interpreter: the drafts that are accepted only
        del proposers["random_speculator"]
    n = len(case.prompts)
    for name, proposer in proposers.items():
        tag = f"{case.tag}.spec_{name}"
        engine = LLMEngine(runner, sched, eos, Drafter(proposer, None, 16))
        on, spec_steps, accepted = run_engine(engine, case.prompts, case.max_new)
        verdicts = [
            "same" if o_on == o_off else judge(o_on, ref, case.near_tie)[0]
            for o_on, o_off, ref in zip(on, off, case.refs, strict=True)
        ]
        r.detail(f"{tag}.verdicts", verdicts)
        same = sum(v == "same" for v in verdicts)
        ok = not any(v == "bad" for v in verdicts)
        r.check(f"{tag}.on_equals_off", f"{same}/{n}", "prompts", status(ok))
        r.check(f"{tag}.tree_steps", spec_steps, "steps", status(spec_steps > 0))
        judged = name == "scripted"
        r.check(f"{tag}.accepted", accepted, "tokens", status(accepted > 0, judged))
        if engine.kv.num_used_blocks != 0:
            r.check(f"{tag}.leaked_blocks", engine.kv.num_used_blocks, "blocks", "FAIL")
