"""The speculator's RMS norm computes in float32 for half-precision inputs (as fms-extras'
LayerNormParameterized with its high-precision power), so the norm of an fp16 state whose
squares exceed fp16's range (|x| > 256) is still right. The oracle is the same maths on the
float32 copy of the inputs and weights."""

from __future__ import annotations

import copy

import torch

from engine.spec_decode.mlp_speculator import MLPSpeculator, SpeculatorNorm
from engine.spec_decode.speculator_config import MLPSpeculatorConfig

D = 64
FP16_ATOL = 2e-2  # a few ulps of fp16 near 1..4, the normalised values' range


def _large_states(*shape: int) -> torch.Tensor:
    """float32 values of magnitude ~300-1000: representable in fp16, their squares are not."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g) * 500


def test_norm_of_fp16_states_beyond_the_square_range_matches_float32() -> None:
    x = _large_states(8, D)
    assert torch.isinf(x.half().pow(2)).any()  # the fp16 square overflows
    norm = SpeculatorNorm(D, torch.float16, torch.device("cpu"))
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, D))
        norm.bias.copy_(torch.linspace(-0.1, 0.1, D))
        ours = norm(x.half())
        ref = copy.deepcopy(norm).float()(x.half().float())
    assert ours.dtype == torch.float16 and torch.isfinite(ours).all()
    torch.testing.assert_close(ours.float(), ref, atol=FP16_ATOL, rtol=0)


def test_fp16_draft_stage_matches_float32() -> None:
    """The in-place drafting stage (the CUDA path's) in fp16 against `stage` in float32."""
    config = MLPSpeculatorConfig(vocab_size=100, emb_dim=D, n_predict=2)
    spec = MLPSpeculator(config)
    spec.reset_parameters(torch.Generator().manual_seed(1))
    half = MLPSpeculator(config, torch.float16)
    half.load_state_dict({k: v.half() for k, v in spec.state_dict().items()})
    projected = _large_states(3, 1, D)  # [G, 1, d]
    tokens = torch.tensor([[5, 7], [11, 13], [17, 19]])  # [G, c]
    with torch.no_grad():
        ours = half._draft_stage(0, projected.half(), tokens)
        emb = spec.emb[0](tokens) * spec.emb_scale
        ref = torch.nn.functional.gelu(spec.ln[0](projected.half().float() + emb)).flatten(0, 1)
    assert ours.dtype == torch.float16 and torch.isfinite(ours).all()
    torch.testing.assert_close(ours.float(), ref, atol=FP16_ATOL, rtol=0)
