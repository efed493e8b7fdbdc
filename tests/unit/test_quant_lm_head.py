"""GPTQ checkpoints whose LM head is quantized too (`"lm_head": true`, GPTQModel's field): the
engine against transformers float32 on the dequantized weights, head included
(tests/quant_reference.py; with int8 activations the oracle fake-quantizes the head's input rows
as it does the projections'), compared as in test_quant_exactness.py (the same tolerances, for
the same reasons); the rows kernel on SmolLM2's head shape (49152 x 576 in groups of 128, whose
last group is short); and the start-up errors for a head declared quantized whose tensors are
missing or wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.quant.kernels
from engine.kernels.quant_rows import build_quant_kernel
from engine.layers.quant_linear import QuantLinear
from engine.llm import LLM
from engine.models.loader import CheckpointError
from engine.paths import model_path
from engine.quant.gptq import assemble, read_part
from engine.quant.reference import reference_linear
from tests.quant_reference import dequantized_weights, oracle_greedy, oracle_model, read_tensors
from tests.reference import TreeRows, chat_prompt_ids, compare_greedy, require_model
from tests.unit.test_quant_exactness import MAX_NEW_TOKENS, compare_a8
from tests.unit.test_quant_kernels import assert_matches
from tools.gptq_writer import GptqOptions, quantize_layer, write_gptq
from tools.tiny_speculator import write_tiny_speculator

TINY_MODELS = ("tiny-llama-gqa-tied", "tiny-llama-mha-untied")
OPTIONS = GptqOptions(bits=4, group_size=16, sym=False, act_order=True, lm_head=True)
_folders: dict[str, Path] = {}


@pytest.fixture
def weight_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight-only product (CUDA's GPTQ one) on CPU, as test_quant_exactness.py runs it."""
    monkeypatch.setattr(engine.quant.kernels, "int8_activations", lambda device, method: False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lm_head")


def _checkpoint(workdir: Path, name: str) -> Path:
    if name not in _folders:
        _folders[name] = write_gptq(require_model(model_path(name)), workdir / name, OPTIONS)
    return _folders[name]


def _oracle(workdir: Path, name: str, int8_activations: bool) -> torch.nn.Module:
    src = model_path(name)
    weights = dequantized_weights(_checkpoint(workdir, name), src, "gptq")
    float_head = read_tensors(src).get("lm_head.weight")
    if float_head is None:
        float_head = read_tensors(src)["model.embed_tokens.weight"]
    assert not torch.equal(weights["lm_head.weight"], float_head)  # the oracle's head is 4-bit
    return oracle_model(src, weights, int8_activations)


def _prompts(name: str, n: int) -> list[list[int]]:
    return [list(p) for p in chat_prompt_ids(model_path(name))[:n]]


def _check_layout(llm: LLM) -> None:
    """The head is quantized; the embedding rows come from the float table."""
    model = llm.runner.model
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.scheme.lm_head
    assert model.embed_tokens is not None and model.embed_tokens.dtype == torch.float32


@pytest.mark.parametrize("name", TINY_MODELS)
def test_int8_activation_greedy_equals_transformers(name: str, workdir: Path) -> None:
    folder = _checkpoint(workdir, name)
    oracle = _oracle(workdir, name, int8_activations=True)
    prompts = _prompts(name, 2)
    for cpu_kernels in (True, False) if name == TINY_MODELS[0] else (True,):
        with LLM(folder, max_num_tokens=1024, cpu_kernels=cpu_kernels) as llm:
            _check_layout(llm)
            outputs = llm.generate(prompts, MAX_NEW_TOKENS, return_logits=True)
        for prompt, out in zip(prompts, outputs, strict=True):
            compare_a8(out, oracle_greedy(oracle, prompt, MAX_NEW_TOKENS))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_weight_only_greedy_equals_transformers(
    name: str, workdir: Path, weight_only: None
) -> None:
    folder = _checkpoint(workdir, name)
    oracle = _oracle(workdir, name, int8_activations=False)
    prompts = _prompts(name, 2)
    with LLM(folder, max_num_tokens=1024) as llm:
        outputs = llm.generate(prompts, MAX_NEW_TOKENS, return_logits=True)
    for prompt, out in zip(prompts, outputs, strict=True):
        ref = oracle_greedy(oracle, prompt, MAX_NEW_TOKENS)
        compare_greedy(out.token_ids, ref, out.logits)


def test_with_a_speculator_greedy_equals_transformers(workdir: Path, tmp_path: Path) -> None:
    name = TINY_MODELS[0]
    folder = _checkpoint(workdir, name)
    oracle = _oracle(workdir, name, int8_activations=True)
    spec = write_tiny_speculator(tmp_path / "spec", model_path(name), n_predict=3)
    prompts = _prompts(name, 2)
    trees = TreeRows()
    with LLM(folder, max_num_tokens=1024, speculator=spec, adaptive_speculation=False) as llm:
        llm.engine.observers.append(trees)
        outputs = llm.generate(prompts, MAX_NEW_TOKENS, return_logits=True)
    assert trees.count > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        compare_a8(out, oracle_greedy(oracle, prompt, MAX_NEW_TOKENS))


def test_a_config_still_declaring_tied_embeddings_serves_the_same(
    workdir: Path, tmp_path: Path
) -> None:
    """A writer that quantized a tied model's head but left `tie_word_embeddings` true: the
    quantized head is still its own layer and the embeddings the float table."""
    name = TINY_MODELS[0]
    folder = shutil.copytree(_checkpoint(workdir, name), tmp_path / "tied")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    prompts = _prompts(name, 2)
    runs = []
    for path in (_checkpoint(workdir, name), folder):
        with LLM(path, max_num_tokens=1024) as llm:
            _check_layout(llm)
            runs.append(llm.generate(prompts, MAX_NEW_TOKENS, return_logits=True))
    for a, b in zip(*runs, strict=True):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))


def test_rows_kernel_on_the_smollm2_head_shape() -> None:
    """49152 x 576 in GPTQ groups of 128: four whole groups and a short one of 64, stored as
    groups of 64 (`engine.quant.gptq.group_order`); 1 to 17 rows (decode and trees)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(49152, 576, generator=g) * 0.05
    o = GptqOptions(bits=4, group_size=128, sym=False)
    t = quantize_layer(w, torch.arange(576), o)
    part = read_part(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=4,
                     zeros_minus_one=True)  # fmt: skip
    qw = assemble([part], 4)
    assert qw.group_size == 64 and qw.out_features == 49152
    forward = build_quant_kernel(qw, None)
    xs = torch.randn(17, 576, generator=g) * 3
    ref = reference_linear(xs, qw, None, int8_activations=True)
    for m in (1, 4, 16, 17):
        assert_matches(forward(xs[:m]), xs[:m], qw, None, ref[:m])


def _broken(workdir: Path, tmp_path: Path, edit: str) -> Path:
    folder = shutil.copytree(_checkpoint(workdir, TINY_MODELS[0]), tmp_path / edit)
    tensors = load_file(str(folder / "model.safetensors"))
    if edit == "no-qweight":
        del tensors["lm_head.qweight"]
    elif edit == "qweight-shape":
        tensors["lm_head.qweight"] = tensors["lm_head.qweight"][:, :-8].contiguous()
    elif edit == "float-head-too":
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    declared = {"not-declared": False, "not-a-bool": "yes"}
    if edit in declared:
        for file in ("config.json", "quantize_config.json"):
            cfg = json.loads((folder / file).read_text())
            cfg.get("quantization_config", cfg)["lm_head"] = declared[edit]
            (folder / file).write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("no-qweight", r"model\.safetensors: missing tensor 'lm_head\.qweight'"),
        ("qweight-shape", r"model\.safetensors: tensor 'lm_head\.qweight' has shape"),
        ("float-head-too", r"model\.safetensors: unexpected tensor 'lm_head\.weight'"),
        (
            "not-declared",
            r"model\.safetensors: tensor 'lm_head\.\w+': a quantized LM head, but "
            r".*quantize_config\.json does not declare 'lm_head' true",
        ),
        ("not-a-bool", r"quantize_config\.json: 'lm_head' must be true or false"),
    ],
)
def test_bad_heads_are_start_up_errors(
    edit: str, message: str, workdir: Path, tmp_path: Path
) -> None:
    folder = _broken(workdir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(folder, max_num_tokens=256)
