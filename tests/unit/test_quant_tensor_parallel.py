"""Quantized layers split over 2 tensor-parallel ranks (gloo, CPU): column-parallel layers by
output rows, row-parallel ones (o_proj, down_proj) by input columns with each rank's GPTQ
groups and scales. The oracle is transformers on the dequantized weights whose row-parallel
inputs are fake-quantized per rank's half (each rank quantizes its own slice of the rows),
compared as in test_quant_exactness.py. A quantized LM head splits by vocabulary rows, each
rank holding every group of its rows. An act-order checkpoint whose groups scatter over the
ranks is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.layers.quant_linear import QuantLinear
from engine.llm import LLM
from engine.models.loader import CheckpointError
from engine.paths import model_path
from tests.quant_reference import (
    column_orders,
    dequantized_weights,
    oracle_greedy,
    oracle_model,
)
from tests.reference import chat_prompt_ids, require_model
from tests.unit.test_quant_exactness import MAX_NEW_TOKENS, compare_a8
from tools.gptq_writer import GptqOptions, write_gptq
from tools.server_process import free_port

TINY = "tiny-llama-gqa-tied"
FORMATS: dict[str, GptqOptions | None] = {
    "int8": None,
    "gptq-4bit-g16-asym": GptqOptions(bits=4, group_size=16, sym=False),
    "gptq-8bit-perchannel-sym-v2": GptqOptions(bits=8, group_size=-1, checkpoint_format="gptq_v2"),
    "gptq-4bit-g16-asym-lm-head": GptqOptions(bits=4, group_size=16, sym=False, lm_head=True),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_ranks_equal_transformers(fmt: str, tmp_path: Path) -> None:
    src = require_model(model_path(TINY))
    options = FORMATS[fmt]
    folder = src if options is None else write_gptq(src, tmp_path / "gptq", options)
    method = "int8" if options is None else "gptq"
    weights = dequantized_weights(folder, src, method)
    orders = column_orders(folder, method, num_shards=2)
    oracle = oracle_model(src, weights, num_shards=2, orders=orders)
    prompts = [list(p) for p in chat_prompt_ids(src)[:2]]
    with LLM(
        folder, max_num_tokens=1024, quantize="int8" if options is None else None,
        tensor_parallel_size=2, master_port=free_port(),
    ) as llm:  # fmt: skip
        o_proj = llm.runner.model.layers[0].self_attn.o_proj
        assert isinstance(o_proj, QuantLinear)
        assert o_proj.unpack_weight().in_features == llm.runner.config.hidden_size // 2
        if options is not None and options.lm_head:  # split by vocabulary rows, groups whole
            head = llm.runner.model.lm_head
            assert isinstance(head, QuantLinear)
            assert head.unpack_weight().out_features == llm.runner.config.vocab_size // 2
            assert head.unpack_weight().in_features == llm.runner.config.hidden_size
        outputs = llm.generate(prompts, MAX_NEW_TOKENS, return_logits=True)
    for prompt, out in zip(prompts, outputs, strict=True):
        compare_a8(out, oracle_greedy(oracle, prompt, MAX_NEW_TOKENS))


def test_act_order_groups_scattered_over_ranks_are_refused(tmp_path: Path) -> None:
    src = require_model(model_path(TINY))
    options = GptqOptions(bits=4, group_size=16, sym=False, act_order=True)
    folder = write_gptq(src, tmp_path / "gptq", options)
    with pytest.raises(CheckpointError, match="act-order checkpoint split along its input"):
        LLM(folder, max_num_tokens=256, tensor_parallel_size=2, master_port=free_port())
