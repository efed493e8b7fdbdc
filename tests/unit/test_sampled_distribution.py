"""Sampling with speculation draws from the model's distribution, whatever the seeds.

A tiny random Llama over an 8-token vocabulary (built here, float32 safetensors) continues a
fixed prompt, 20,000 times, each request with its own random seed (`seed=None`), so the check
does not lean on the seed mechanism; the first 3 of its 4 sampled tokens are counted. With
speculation every request drafts after its first token: a tree of 4 candidate paths two deep
(top-4 then top-2), so the second and third tokens come from accepted drafts at depths 1 and 2
or from the rows where the tree is left.

Oracle: transformers' own `LlamaForCausalLM` on the saved folder gives the exact distribution of
the 8**3 continuations, p(a, b, c) = softmax(l1 / T)[a] * softmax(l2 / T)[b] * softmax(l3 / T)[c]
with the logits l of the prompt, the prompt + a and the prompt + a, b (TGIS applies a
temperature T as logits / T), all in float64.

Statistics: Pearson's chi-square goodness of fit of the observed counts against 20,000 * p, the
cells expected fewer than 5 times pooled into one, with (cells - 1) degrees of freedom; its
p-value is the chi-square survival function, the regularised upper incomplete gamma function
Q(dof / 2, statistic / 2) (`torch.special.gammaincc`). Plain sampling and sampling with a random
MLP speculator's drafts verified both pass (p > 0.01), and a chi-square test of homogeneity over
the same cells finds their two samples alike. The same test rejects (p < 0.01) a sampler drawing
at a slightly wrong temperature and one whose keyed noise ignores the token's position. The
Python `random` state that unseeded requests take their seeds from is fixed per run, so every
statistic is deterministic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

import engine.sampling.batch_choice as batch_choice
from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling.keyed_draw import keys_of
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.loader import load_speculator
from engine.spec_decode.proposer import MLPProposer
from tools.tiny_speculator import write_tiny_speculator

VOCAB = 8
HIDDEN = 32
PROMPT = (1, 5, 2, 7)
NUM_NEW = 3
"""Tokens counted; the requests sample one more, so that a two-deep tree fits after the first."""
NUM_SAMPLES = 20_000
TEMPERATURE = 1.0
WRONG_TEMPERATURE = 1.1
BATCH = 256
"""Requests running at once; the drafter drafts for all of them."""
MIN_EXPECTED = 5.0
ALPHA = 0.01
MODEL_SEED = 0
LINEAR_STD, EMBED_STD, FINAL_NORM_SCALE = 0.3, 1.0, 0.8


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float


@dataclass(frozen=True)
class Sample:
    counts: torch.Tensor  # [VOCAB**3] int64: continuation (a, b, c) at a * VOCAB**2 + b * VOCAB + c
    num_tokens: int
    num_verified: int  # outputs of a step that verified a draft tree
    num_accepted: int  # tokens that came from accepted drafts
    num_two_accepted: int  # verified trees whose two-deep path was accepted whole


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square distributed with `dof` degrees of freedom."""
    a = torch.tensor(dof / 2, dtype=torch.float64)
    x = torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


def pool(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[..., cells] -> [..., kept cells (+ 1 pooled cell of the others, when there are any)]."""
    if bool(keep.all()):
        return values[..., keep]
    return torch.cat([values[..., keep], values[..., ~keep].sum(-1, keepdim=True)], dim=-1)


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> ChiSquare:
    """Pearson's test of `counts` against the cell probabilities `probs`."""
    n = float(counts.sum())
    expected = probs.double() * n
    keep = expected >= MIN_EXPECTED
    observed, expected = pool(counts.double(), keep), pool(expected, keep)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    return ChiSquare(statistic, dof, chi2_sf(statistic, dof))


def homogeneity(counts_a: torch.Tensor, counts_b: torch.Tensor, probs: torch.Tensor) -> ChiSquare:
    """Pearson's test that two samples share one distribution, over the cells `probs` expects
    at least `MIN_EXPECTED` times in the smaller sample (the others pooled)."""
    n = float(min(counts_a.sum(), counts_b.sum()))
    table = pool(torch.stack([counts_a, counts_b]).double(), probs * n >= MIN_EXPECTED)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return ChiSquare(statistic, dof, chi2_sf(statistic, dof))


def build_model(out: Path) -> Path:
    """A seeded random Llama with weights large enough that each next-token distribution has
    clear structure, saved in float32."""
    config = HFLlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(MODEL_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1:
                scale = FINAL_NORM_SCALE if name == "model.norm.weight" else 1.0
                param.copy_(scale * (1.0 + 0.1 * noise))
            elif "embed_tokens" in name:
                param.copy_(EMBED_STD * noise)
            else:
                param.copy_(LINEAR_STD * noise)
    model.save_pretrained(out)
    return out


def exact_distribution(model_dir: Path, temperature: float) -> torch.Tensor:
    """[VOCAB**3] float64: p(a, b, c) of the 3-token continuations of PROMPT, from transformers."""
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prefixes = torch.tensor([[*PROMPT, a, b] for a in range(VOCAB) for b in range(VOCAB)])
    with torch.no_grad():
        logits = model(prefixes).logits.double()  # [VOCAB**2, len + 2, VOCAB]
    logp = (logits / temperature).log_softmax(-1)
    n = len(PROMPT)
    first = logp[0, n - 1]  # [a]
    second = logp[::VOCAB, n]  # [a, b]
    third = logp[:, n + 1].reshape(VOCAB, VOCAB, VOCAB)  # [a, b, c]
    joint = first[:, None, None] + second[:, :, None] + third
    return joint.exp().flatten()


def make_engine(model_dir: Path, speculator_dir: Path | None) -> LLMEngine:
    """An engine without EOS (every continuation has NUM_NEW tokens); with `speculator_dir`,
    its random MLP speculator drafts 4 two-deep candidates for every running request."""
    runner = ModelRunner(
        EngineConfig(model_dir, dtype="float32", block_size=16, num_kv_blocks=2 * BATCH)
    )
    config = SchedulerConfig(
        max_num_seqs=BATCH, max_num_batched_tokens=16 * BATCH, max_model_len=32
    )
    drafter = None
    if speculator_dir is not None:
        speculator = load_speculator(
            speculator_dir,
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            dtype=runner.dtype,
            device="cpu",
        )
        drafter = Drafter(MLPProposer(speculator, [4, 2], 4), None, max_batch_size=BATCH)
    return LLMEngine(runner, config, frozenset(), drafter)


def sample(
    model_dir: Path,
    speculator_dir: Path | None,
    run_seed: int,
    temperature: float = TEMPERATURE,
) -> Sample:
    """NUM_SAMPLES unseeded continuations of PROMPT, at most BATCH running at once; the
    requests' seeds come from Python's `random` seeded with `run_seed`. The engine runs on one
    intra-op thread: a tiny model's steps are fastest there, most of all on a busy machine."""
    params = SamplingParams(max_new_tokens=NUM_NEW + 1, temperature=temperature, seed=None)
    tokens: dict[str, list[int]] = {}
    num_verified = num_accepted = num_two_accepted = 0
    counts = torch.zeros(VOCAB**NUM_NEW, dtype=torch.int64)
    state, threads = random.getstate(), torch.get_num_threads()
    random.seed(run_seed)
    torch.set_num_threads(1)
    try:
        engine = make_engine(model_dir, speculator_dir)
        num_added = 0
        while num_added < NUM_SAMPLES or engine.has_unfinished_requests():
            while num_added < NUM_SAMPLES and engine.scheduler.num_waiting < BATCH:
                engine.add_request(str(num_added), PROMPT, params)
                tokens[str(num_added)] = []
                num_added += 1
            for out in engine.step().outputs:
                assert out.error is None, out.error
                tokens[out.request_id] += out.new_token_ids
                if out.draft_depth > 0:
                    num_verified += 1
                    num_accepted += out.num_accepted_tokens
                    num_two_accepted += out.num_accepted_tokens == 2
                if out.finished:
                    a, b, c, _ = tokens.pop(out.request_id)
                    counts[(a * VOCAB + b) * VOCAB + c] += 1
    finally:
        random.setstate(state)
        torch.set_num_threads(threads)
    assert not tokens
    assert int(counts.sum()) == NUM_SAMPLES
    return Sample(counts, (NUM_NEW + 1) * NUM_SAMPLES, num_verified, num_accepted, num_two_accepted)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-vocab-llama"))


@pytest.fixture(scope="module")
def speculator_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return write_tiny_speculator(
        tmp_path_factory.mktemp("speculator"), model_dir, n_predict=2, inner_dim=32
    )


@pytest.fixture(scope="module")
def exact(model_dir: Path) -> torch.Tensor:
    return exact_distribution(model_dir, TEMPERATURE)


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> Sample:
    return sample(model_dir, None, run_seed=1)


@pytest.fixture(scope="module")
def speculative(model_dir: Path, speculator_dir: Path) -> Sample:
    return sample(model_dir, speculator_dir, run_seed=2)


@pytest.fixture
def position_blind_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keyed draw's noise ignores the position: every token of a request reuses one
    Gumbel vector."""

    def blind(parts: torch.Tensor) -> torch.Tensor:  # [M, 3]: seed low, seed high, position
        return keys_of(torch.cat([parts[:, :2], torch.zeros_like(parts[:, 2:])], dim=1))

    monkeypatch.setattr(batch_choice, "keys_of", blind)


def test_exact_distribution_has_structure(exact: torch.Tensor) -> None:
    """Far from uniform and far from one token: each next-token distribution keeps a good
    share of the vocabulary's entropy, and no continuation dominates."""
    assert math.isclose(float(exact.sum()), 1.0, abs_tol=1e-9)
    joint = exact.reshape(VOCAB, VOCAB, VOCAB)
    conditionals = [
        joint.sum((1, 2)).reshape(1, VOCAB),
        (joint.sum(2) / joint.sum((1, 2))[:, None]).reshape(-1, VOCAB),
        (joint / joint.sum(2, keepdim=True)).reshape(-1, VOCAB),
    ]
    for probs in conditionals:
        entropy = -(probs * probs.log()).sum(-1)
        assert 0.4 * math.log(VOCAB) < float(entropy.mean()) < 0.85 * math.log(VOCAB)
        assert float(probs.max()) < 0.95
    assert float(exact.max()) < 0.1
    assert int((exact * NUM_SAMPLES >= MIN_EXPECTED).sum()) >= 150


def test_plain_sampling_matches_the_exact_distribution(plain: Sample, exact: torch.Tensor) -> None:
    assert plain.num_verified == 0
    assert goodness_of_fit(plain.counts, exact).p_value > ALPHA


def test_speculative_sampling_matches_the_exact_distribution(
    speculative: Sample, plain: Sample, exact: torch.Tensor
) -> None:
    """Every request verifies a draft tree (its second step, and a second tree when the first
    gained one token); a good share of all tokens are accepted drafts, some both of a path."""
    assert speculative.num_verified >= NUM_SAMPLES
    assert speculative.num_two_accepted > 0.02 * NUM_SAMPLES
    assert speculative.num_accepted > 0.1 * speculative.num_tokens
    assert goodness_of_fit(speculative.counts, exact).p_value > ALPHA
    assert homogeneity(speculative.counts, plain.counts, exact).p_value > ALPHA


def test_a_wrong_temperature_is_detected(
    model_dir: Path, speculator_dir: Path, exact: torch.Tensor
) -> None:
    biased = sample(model_dir, speculator_dir, run_seed=3, temperature=WRONG_TEMPERATURE)
    assert biased.num_accepted > 0
    assert goodness_of_fit(biased.counts, exact).p_value < ALPHA


@pytest.mark.usefixtures("position_blind_noise")
def test_noise_reused_across_positions_is_detected(
    model_dir: Path, speculator_dir: Path, exact: torch.Tensor
) -> None:
    biased = sample(model_dir, speculator_dir, run_seed=4)
    assert biased.num_accepted > 0
    assert goodness_of_fit(biased.counts, exact).p_value < ALPHA
