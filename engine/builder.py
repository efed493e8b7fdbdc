"""The one assembly of an engine: model runner, scheduler limits, speculator -> proposer ->
policy -> drafter, `LLMEngine`. The offline `LLM` and the server both call `build_engine`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core import LLMEngine
from engine.device import use_device
from engine.kv_sizing import MemoryGauge, check_pool
from engine.model_runner import ModelRunner, resolve_dtype
from engine.models.llama import LlamaConfig
from engine.parallel.runner import start_sharded_runner
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.loader import load_speculator
from engine.spec_decode.policy import SpeculationPolicy
from engine.spec_decode.proposer import MLPProposer, Proposer

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer in the model folder; OSError naming the folder when it has none."""
    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError) as e:
        raise OSError(f"{model_path}: cannot load the tokenizer: {e}") from e


def build_engine(
    config: EngineConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    proposer: Proposer | None = None,
    memory: MemoryGauge | None = None,
) -> LLMEngine:
    """Load the model and assemble its engine, on `config.device` (made this thread's current
    CUDA device, see `engine.device`; the thread that runs `step` makes `runner.device` its
    own). EOS ids are the model config's plus the tokenizer's. A `proposer` (any drafter,
    e.g. a test double) takes the place of the speculator `config.speculative` names; its
    tree shape and batch limit still apply.
    The speculator is read (and checked against the model's config) before the model's
    weights load, so a bad speculator fails fast. Raises CheckpointError naming the
    speculator's path, or ValueError when the KV pool cannot hold one request of
    `config.max_model_len` (capped at the model's sliding window, see `ModelRunner`).
    `memory` replaces the device's own memory gauge in the KV sizing rule (`ModelRunner`)."""
    use_device(config.device)
    spec = config.speculative or SpeculativeConfig()
    if proposer is None and spec.path is not None:
        model_config = LlamaConfig.from_folder(Path(config.model_path))
        dtype = resolve_dtype(config.dtype, model_config.torch_dtype, config.device)
        proposer = _load_proposer(spec.path, spec, model_config, dtype, torch.device(config.device))
    sharded = config.tensor_parallel_size > 1
    if sharded:
        runner: ModelRunner = start_sharded_runner(config, memory)
    else:
        runner = ModelRunner(config, memory=memory)
    try:
        return _assemble(config, runner, tokenizer, proposer)
    except BaseException:
        runner.close()
        raise


def _assemble(
    config: EngineConfig,
    runner: ModelRunner,
    tokenizer: PreTrainedTokenizerBase | None,
    proposer: Proposer | None,
) -> LLMEngine:
    spec = config.speculative or SpeculativeConfig()
    max_model_len = runner.max_model_len
    if config.max_model_len is not None:
        how = runner.kv_pool_source
        logger.info(check_pool(runner.num_blocks, runner.block_size, max_model_len, how))
    eos_token_ids = set(runner.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_token_ids.add(tokenizer.eos_token_id)
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    drafter = None
    if proposer is not None:
        policy = SpeculationPolicy(proposer.num_candidates) if spec.adaptive else None
        drafter = Drafter(proposer, policy, spec.max_batch_size)
    return LLMEngine(
        runner, scheduler_config, frozenset(eos_token_ids), drafter, config.enable_prefix_caching
    )


def _load_proposer(
    path: Path,
    spec: SpeculativeConfig,
    model_config: LlamaConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> MLPProposer:
    speculator = load_speculator(
        path,
        hidden_size=model_config.hidden_size,
        vocab_size=model_config.vocab_size,
        dtype=dtype,
        device=device,
        n_predict=spec.n_predict,
    )
    proposer = MLPProposer(
        speculator, spec.top_k_tokens_per_head, spec.n_candidates, spec.candidate_selection
    )
    logger.info(
        "speculator %s: %d heads drafting from %d tokens, top-k per head %s, %d candidates by "
        "%s, up to batch size %d",
        path,
        speculator.config.n_predict,
        speculator.num_draft_tokens,
        list(proposer.top_k_tokens_per_head),
        proposer.num_candidates,
        proposer.selection,
        spec.max_batch_size,
    )
    return proposer
