"""Section `sharded`: NUM_SHARD=2 against one shard.

With two visible GPUs: the tiny GQA Llama in float16 split over two ranks (NCCL), its KV pool
sized from device memory as the server sizes it when no KV_CACHE_* setting is given (every
rank profiles its own step, the pool is the smaller rank's), greedy output against the same
model on one GPU (a difference must be a near-tie in the one-shard logits). With one GPU the
section says so (INFO). On CPU it runs the same over gloo in float32 (the CPU pool rule), so
that a dry run exercises the section's code.
"""

from __future__ import annotations

from bench.gpu_check.models import (
    TINY_MODELS,
    Reference,
    judge,
    prompt_ids,
    run_engine,
    write_tiny_llama,
)
from bench.gpu_check.report import FP16_NEAR_TIE, FP32_NEAR_TIE, Ctx, status

NUM_SHARDS = 2


def section_sharded(ctx: Ctx) -> None:
    import torch

    r = ctx.report
    if ctx.cuda and torch.cuda.device_count() < NUM_SHARDS:
        r.check("sharded.skipped", f"{torch.cuda.device_count()}_gpu", "-", "INFO")
        return
    from engine import LLM
    from engine.builder import build_engine
    from engine.config import EngineConfig
    from engine.parallel.runner import LeaderRunner
    from tools.server_process import free_port

    spec = TINY_MODELS[1]  # 2 KV heads: one per rank
    folder = ctx.tmp / f"sharded-{spec.name}"
    write_tiny_llama(folder, spec)
    dtype_name, near_tie = ("float16", FP16_NEAR_TIE) if ctx.cuda else ("float32", FP32_NEAR_TIE)
    prompts = prompt_ids(spec.vocab_size, (5, 17, 40), spec.seed)
    max_new = 16
    with LLM(folder, dtype=dtype_name, device=ctx.device, max_num_tokens=2048) as one:
        refs = one.generate(prompts, max_new, return_logits=True)
    config = EngineConfig(
        model_path=folder,
        dtype=dtype_name,
        device=ctx.device,
        max_num_batched_tokens=512,
        tensor_parallel_size=NUM_SHARDS,
        master_port=free_port(),
        shard_timeout_s=60.0,
    )
    engine = build_engine(config)
    try:
        runner = engine.runner
        assert isinstance(runner, LeaderRunner)
        r.check("sharded.kv_pool_blocks", runner.num_blocks, "blocks", "INFO")
        r.detail("kv_pool_source", runner.kv_pool_source)
        from_memory = runner.kv_pool_source.startswith("memory fraction")
        r.check("sharded.kv_pool_from_memory", from_memory, "-", status(from_memory, ctx.cuda))
        ours, _, _ = run_engine(engine, prompts, max_new)
    finally:
        engine.close()
    verdicts = [
        judge(o, Reference(ref.token_ids, ref.logits), near_tie)
        for o, ref in zip(ours, refs, strict=True)
    ]
    r.detail("verdicts", verdicts)
    same = sum(v == "same" for v, _ in verdicts)
    ok = all(v != "bad" for v, _ in verdicts)
    r.check("sharded.equals_one_shard", f"{same}/{len(prompts)}", "prompts", status(ok))
