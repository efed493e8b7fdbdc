"""Section `speed`: a Llama-2-13B-shaped model with random fp16 weights: step times against
what the bytes each step moves allow."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from bench.gpu_check.environment import BANDWIDTH
from bench.gpu_check.models import (
    SPEED_13B,
    SPEED_SMALL,
    heap_tree,
    random_weights,
    write_llama_config,
)
from bench.gpu_check.report import Ctx, status, timed

BATCH_EFFICIENCY = 0.75
"""Batch 32's speed-up over batch 1 must reach this share of what the bytes moved allow (at
context 512 on Llama-2-13B: 25.7 GB of weights, plus 13.4 GB of KV at batch 32, about 21x)."""


def ideal_speedup(batch: int, ctx_len: int, weight_bytes: int, kv_token_bytes: int) -> float:
    """Tokens per second at `batch` decode rows of `ctx_len` cached tokens over those at one
    row, were both steps bound by the bytes they read (every weight once, each row's K/V):
    batch * bytes(1) / bytes(batch)."""
    one = weight_bytes + ctx_len * kv_token_bytes
    return batch * one / (weight_bytes + batch * ctx_len * kv_token_bytes)


def section_speed(ctx: Ctx) -> None:
    import torch

    from engine.builder import build_engine
    from engine.config import EngineConfig
    from engine.kv_sizing import kv_block_bytes
    from engine.spec_decode.mlp_speculator import MLPSpeculator
    from engine.spec_decode.proposer import MLPProposer, ProposalInput
    from engine.spec_decode.speculator_config import MLPSpeculatorConfig
    from engine.step_io import SequenceInput

    r = ctx.report
    if not ctx.cuda and not ctx.small:
        r.check("speed.skipped", "cpu", "-", "INFO")
        return
    small, judged = ctx.small, ctx.judged
    shape = SPEED_SMALL if small else SPEED_13B
    contexts = (32, 64) if small else (512, 2048)
    chunk_tokens = 96 if small else 1792
    repeats = 3 if small else 10
    folder = ctx.tmp / "speed-model"
    dtype_name = "float16" if ctx.cuda else "float32"
    write_llama_config(folder, shape, dtype_name)
    config = EngineConfig(
        model_path=folder,
        dtype=dtype_name,
        device=ctx.device,
        max_num_seqs=64,
        max_num_batched_tokens=2048 if not small else 256,
        kv_cache_tokens=64 * (contexts[-1] + 64) + 4096 if not ctx.cuda else None,
        enable_prefix_caching=False,
    )
    start = time.perf_counter()
    with random_weights():
        engine = build_engine(config)
    runner, kv = engine.runner, engine.kv
    ctx.sync()
    r.check("speed.model_build", time.perf_counter() - start, "s", "INFO")
    r.check("speed.attention_backend", runner.backend.name, "-", "INFO")
    weight_bytes = sum(
        lin.storage.numel() * lin.storage.element_size() for lin in runner.model.linears()
    )
    r.check("speed.weight_bytes", weight_bytes / 1e9, "GB", "INFO")
    kv_token_bytes = kv_block_bytes(
        runner.config, 1, runner.dtype, runner.model.layout.num_kv_heads
    )
    r.check("speed.kv_bytes_per_token", kv_token_bytes / 2**10, "KiB", "INFO")

    def step_bytes(batch: int, ctx_len: int) -> int:
        """What a decode step must read: every weight once, and each row's cached K/V."""
        return weight_bytes + batch * ctx_len * kv_token_bytes

    r.check("speed.kv_pool_blocks", runner.num_blocks, "blocks", "INFO")
    r.check("speed.kv_pool_tokens", runner.num_blocks * runner.block_size, "tokens", "INFO")
    r.detail("kv_pool_source", runner.kv_pool_source)
    if ctx.cuda:
        r.check("speed.memory_after_load", torch.cuda.memory_allocated() / 2**30, "GiB", "INFO")

    counter = [0]

    def new_seqs(batch: int, tokens: int) -> list[tuple[str, list[int]]]:
        """`batch` sequences with room for `tokens` tokens each. Their cached context is whatever
        the pool holds (no prefill): attention reads it at the same cost whatever its values."""
        seqs: list[tuple[str, list[int]]] = []
        for _ in range(batch):
            counter[0] += 1
            seq_id = f"speed-{counter[0]}"
            if not kv.allocate_slots(seq_id, tokens):
                for s, _ in seqs:
                    kv.free(s)
                raise MemoryError(f"KV pool too small for {batch} x {tokens} tokens")
            seqs.append((seq_id, kv.block_table(seq_id)))
        return seqs

    def free(seqs: list[tuple[str, list[int]]]) -> None:
        for s, _ in seqs:
            kv.free(s)

    def decode_inputs(seqs: list[tuple[str, list[int]]], ctx_len: int) -> list[SequenceInput]:
        return [SequenceInput([7], ctx_len, table) for _, table in seqs]

    def tree_input(table: list[int], ctx_len: int, rows: int) -> SequenceInput:
        tree = heap_tree(rows)
        return SequenceInput(
            [7, *tree.token_ids], ctx_len, table,
            positions=[ctx_len + d for d in tree.depths],
            tree_mask=tree.attention_mask(), logits_indices=list(range(rows)),
        )  # fmt: skip

    def run(inputs: list[SequenceInput]) -> Callable[[], object]:
        return lambda: runner.execute(inputs)

    results: dict[str, float] = {}

    def step_b1() -> None:
        for ctx_len in contexts:
            seqs = new_seqs(1, ctx_len + 1)
            try:
                inputs = decode_inputs(seqs, ctx_len)
                sec = timed(ctx, run(inputs), repeats)
            finally:
                free(seqs)
            results[f"b1_{ctx_len}"] = sec
            r.check(f"speed.decode_b1_ctx{ctx_len}.step", sec * 1e3, "ms", "INFO")
            r.check(f"speed.decode_b1_ctx{ctx_len}.tok_s", 1 / sec, "tok/s", "INFO")
        graphs = runner.graphs
        if graphs is not None:
            seqs = new_seqs(1, contexts[0] + 1)
            runner.graphs = None
            try:
                eager = timed(ctx, run(decode_inputs(seqs, contexts[0])), repeats)
            finally:
                runner.graphs = graphs
                free(seqs)
            r.check(f"speed.decode_b1_ctx{contexts[0]}.eager_step", eager * 1e3, "ms", "INFO")
            r.check(
                "speed.decode_b1.graph_speedup", eager / results[f"b1_{contexts[0]}"], "x", "INFO"
            )
        bw = BANDWIDTH.get("GB/s")
        if bw:
            bound = step_bytes(1, contexts[0]) / (bw * 1e9)
            sec = results[f"b1_{contexts[0]}"]
            r.check("speed.decode_b1.bandwidth_bound", bound * 1e3, "ms", "INFO")
            r.check(
                "speed.decode_b1.over_bound", sec / bound, "x", status(sec <= 1.25 * bound, judged)
            )
        else:
            r.check("speed.decode_b1.over_bound", "no_bandwidth", "-", "INFO")

    ctx.step("speed.decode_b1", step_b1)

    def step_verify() -> None:
        ctx_len = contexts[0]
        seqs = new_seqs(1, ctx_len + 33)
        try:
            table = seqs[0][1]
            plain = timed(
                ctx, lambda: runner.execute([SequenceInput([7], ctx_len, table)]), repeats
            )
            r.check("speed.verify.rows1", plain * 1e3, "ms", "INFO")
            for rows in (4, 8, 16, 32):
                inputs = [tree_input(table, ctx_len, rows)]
                sec = timed(ctx, run(inputs), repeats)
                ratio = sec / plain
                r.check(f"speed.verify.rows{rows}", sec * 1e3, "ms", "INFO")
                st = status(ratio <= 1.15, judged) if rows == 16 else "INFO"
                r.check(f"speed.verify.rows{rows}_over_rows1", ratio, "x", st)
            graphs = runner.graphs
            if graphs is not None:
                runner.graphs = None
                try:
                    eager = timed(ctx, run([tree_input(table, ctx_len, 16)]), repeats)
                finally:
                    runner.graphs = graphs
                r.check("speed.verify.rows16.eager_step", eager * 1e3, "ms", "INFO")
        finally:
            free(seqs)

    ctx.step("speed.verify", step_verify, min_left=5)

    def step_draft() -> None:
        hidden = shape["hidden_size"]
        spec_config = MLPSpeculatorConfig(
            vocab_size=shape["vocab_size"], emb_dim=hidden, inner_dim=64 if small else 4096,
            n_predict=3, top_k_tokens_per_head=(5, 3, 2), n_candidates=5,
        )  # fmt: skip
        dtype = runner.dtype
        speculator = MLPSpeculator(spec_config, dtype=dtype, device=ctx.device)
        with torch.no_grad():
            for name, p in speculator.named_parameters():
                if name.startswith("ln."):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.normal_(0.0, 1 / math.sqrt(spec_config.inner_dim))
        proposer = MLPProposer(speculator, (5, 3, 2), 5)
        state = torch.randn(hidden, device=ctx.device, dtype=dtype)
        inputs = [ProposalInput("speed", [1, 5, 9, 7], state, 3)]
        trees: list[Any] = []
        sec = timed(ctx, lambda: trees.append(proposer.propose(inputs)[0]), repeats)
        r.check("speed.draft_532x5", sec * 1e3, "ms", "INFO")
        r.check("speed.draft_532x5.tree_rows", trees[-1].num_drafts + 1, "rows", "INFO")

    ctx.step("speed.draft", step_draft, min_left=5)

    def step_batches() -> None:
        for ctx_len in contexts:
            for batch in (8, 32, 64):
                name = f"speed.decode_b{batch}_ctx{ctx_len}"
                if ctx.left() < 8:
                    r.check(f"{name}.skipped", "time", "-", "INFO")
                    continue
                need = batch * math.ceil((ctx_len + 1) / runner.block_size)
                if need > kv.num_free_blocks:
                    r.check(
                        f"{name}.skipped", f"pool_{kv.num_free_blocks}<{need}_blocks", "-", "INFO"
                    )
                    continue
                seqs = new_seqs(batch, ctx_len + 1)
                try:
                    inputs = decode_inputs(seqs, ctx_len)
                    sec = timed(ctx, run(inputs), repeats)
                finally:
                    free(seqs)
                tok_s = batch / sec
                r.check(f"{name}.step", sec * 1e3, "ms", "INFO")
                r.check(f"{name}.tok_s", tok_s, "tok/s", "INFO")
                b1 = results.get(f"b1_{ctx_len}")
                if b1:
                    scale = tok_s * b1
                    ideal = ideal_speedup(batch, ctx_len, weight_bytes, kv_token_bytes)
                    r.check(f"{name}.ideal_over_b1", ideal, "x", "INFO")
                    judged_here = judged and batch == 32 and ctx_len == contexts[0]
                    ok = scale >= BATCH_EFFICIENCY * ideal
                    st = status(ok, judged_here) if batch == 32 else "INFO"
                    r.check(f"{name}.over_b1", scale, "x", st)

    ctx.step("speed.batches", step_batches, min_left=8)

    def step_mixed() -> None:
        ctx_len = contexts[0]
        trees = new_seqs(16, ctx_len + 17)
        chunk = new_seqs(1, chunk_tokens)
        try:
            tree_inputs = [tree_input(table, ctx_len, 16) for _, table in trees]
            chunk_input = [SequenceInput([7] * chunk_tokens, 0, chunk[0][1])]
            t_trees = timed(ctx, lambda: runner.execute(tree_inputs), repeats)
            t_chunk = timed(ctx, lambda: runner.execute(chunk_input), repeats)
            t_mixed = timed(ctx, lambda: runner.execute(tree_inputs + chunk_input), repeats)
        finally:
            free(trees)
            free(chunk)
        r.check("speed.mixed.trees16x16", t_trees * 1e3, "ms", "INFO")
        r.check(f"speed.mixed.chunk{chunk_tokens}", t_chunk * 1e3, "ms", "INFO")
        r.check("speed.mixed.both", t_mixed * 1e3, "ms", "INFO")
        r.check("speed.mixed.over_parts", t_mixed / (t_trees + t_chunk), "x", "INFO")

    ctx.step("speed.mixed", step_mixed, min_left=5)
    if ctx.cuda:
        r.check("speed.peak_memory", torch.cuda.max_memory_allocated() / 2**30, "GiB", "INFO")
        kv_bytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
        r.check("speed.kv_pool_memory", kv_bytes / 2**30, "GiB", "INFO")
