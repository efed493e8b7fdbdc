"""The speculator as it is trained: MLPSpeculator with its vocabulary-sized matrices expressed
through the frozen base model, a distillation loss over a candidate vocabulary, and export to a
plain MLPSpeculator.

The expensive parts of a speculator are its [vocab, inner] embeddings and heads (49152 x 576 for
SmolLM2). Training keeps them factored:

    emb_i(tok)  = E[tok] @ B_i^T           E: the base input embeddings [vocab, hidden] (frozen)
    logits_i(s) = W @ (A_i s)              W: the base LM head [vocab, hidden] (frozen)

with small trainable maps B_i [inner, hidden] and A_i [hidden, inner] (identity at the start when
inner_dim == hidden, so the speculator starts from the base model's own embeddings and head).
Every token keeps a meaningful embedding and logit even if the training data never shows it, and
export multiplies the factors out into the published format (`emb.i.weight = E B_i^T`,
`head.i.weight = W A_i`). `frozen` keeps a map at identity (head = the LM head exactly); `full`
trains the whole [vocab, inner] matrix instead.

The loss is each head's cross-entropy against the teacher's top-k distribution under a softmax
over the training vocabulary, which is also the speculator's draft vocabulary: the tokens most
often the teacher's top-1 in the data, or every token among its top-k anywhere in it (about a
third of SmolLM2's vocabulary on chat answers), or the whole vocabulary. Tokens outside it seldom
win the base model's argmax, and hardly ever where a draft would be accepted, so leaving them out
keeps acceptance while making each step several times cheaper (figures: docs/training.md). The
candidates are the plausible tokens themselves, not the batch's targets plus random negatives: a
softmax over those learns to beat easy negatives rather than the tokens that compete with the
right one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.loader import CheckpointError, checkpoint_files, iter_tensors
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.speculator_config import MLPSpeculatorConfig
from training.data import Batch

MATRIX_MODES = ("factored", "frozen", "full")


class BaseMatrices(NamedTuple):
    embedding: torch.Tensor  # [vocab, hidden] float32: the base model's input embeddings
    lm_head: torch.Tensor  # [vocab, hidden] float32 (the same tensor when tied)


def read_base_matrices(model_path: str | Path) -> BaseMatrices:
    """The input embedding and LM head of the HF Llama folder `model_path`, as float32 on the
    CPU. Raises CheckpointError when the embedding is missing."""
    folder = Path(model_path)
    files, _ = checkpoint_files(folder)
    found: dict[str, torch.Tensor] = {}
    wanted = ("model.embed_tokens.weight", "lm_head.weight")
    for file in files:
        for name, tensor in iter_tensors(file):
            if name in wanted:
                found[name] = tensor.float().contiguous()
    if wanted[0] not in found:
        raise CheckpointError(f"{folder}: no tensor 'model.embed_tokens.weight'")
    embedding = found[wanted[0]]
    return BaseMatrices(embedding, found.get(wanted[1], embedding))


def _initial_map(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Identity when square, else a random matrix with orthonormal rows or columns."""
    if rows == cols:
        return torch.eye(rows)
    q, _ = torch.linalg.qr(torch.randn(max(rows, cols), min(rows, cols), generator=generator))
    return q if rows > cols else q.t().contiguous()


class FactoredEmbedding(nn.Module):
    """`emb(tok) = base[tok] @ map^T`, with a frozen `base` [vocab, hidden] and a map
    [inner, hidden] that is trained unless `trainable` is false."""

    base: torch.Tensor

    def __init__(
        self, base: torch.Tensor, inner_dim: int, trainable: bool, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.register_buffer("base", base, persistent=False)
        initial = _initial_map(inner_dim, base.shape[1], generator)
        self.map = nn.Parameter(initial, requires_grad=trainable)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., inner]
        return F.embedding(token_ids, self.base) @ self.map.t()

    def materialize(self) -> torch.Tensor:  # [vocab, inner]
        return self.base @ self.map.t()


def _initial_matrix(base: torch.Tensor, inner_dim: int, generator: torch.Generator) -> torch.Tensor:
    """A [vocab, inner] matrix to train: a copy of `base` when the widths match, else random."""
    if base.shape[1] == inner_dim:
        return base.clone()
    return torch.randn(base.shape[0], inner_dim, generator=generator) / inner_dim**0.5


class FullEmbedding(nn.Module):
    """A trained [vocab, inner] embedding (the base's rows when the widths match)."""

    def __init__(self, base: torch.Tensor, inner_dim: int, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(_initial_matrix(base, inner_dim, generator))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)

    def materialize(self) -> torch.Tensor:
        return self.weight.detach()


class FactoredHead(nn.Module):
    """Logits `base @ (map s)`: `forward` gives the features `map s` [..., hidden], `rows(ids)`
    the frozen base rows they are scored against; `map` [hidden, inner] is trained unless
    `trainable` is false."""

    base: torch.Tensor

    def __init__(
        self, base: torch.Tensor, inner_dim: int, trainable: bool, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.register_buffer("base", base, persistent=False)
        initial = _initial_map(base.shape[1], inner_dim, generator)
        self.map = nn.Parameter(initial, requires_grad=trainable)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return state @ self.map.t()

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:  # [C] -> [C, hidden]
        return self.base[token_ids]

    def materialize(self) -> torch.Tensor:  # [vocab, inner]
        return self.base @ self.map


class FullHead(nn.Module):
    """A trained [vocab, inner] head (the base LM head when the widths match): features are
    the state itself."""

    def __init__(self, base: torch.Tensor, inner_dim: int, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(_initial_matrix(base, inner_dim, generator))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]

    def materialize(self) -> torch.Tensor:
        return self.weight.detach()


Embedding = FactoredEmbedding | FullEmbedding
Head = FactoredHead | FullHead


class TrainableSpeculator(nn.Module):
    """An MLPSpeculator (`core`) whose `emb` and `head` modules are replaced by the trainable
    forms above (shared across stages with `tie_weights`, as in MLPSpeculator). `forward` is
    MLPSpeculator's teacher-forced forward, giving head features instead of logits."""

    def __init__(
        self,
        config: MLPSpeculatorConfig,
        base: BaseMatrices,
        *,
        head: str = "factored",
        embedding: str = "factored",
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, mode in (("head", head), ("embedding", embedding)):
            if mode not in MATRIX_MODES:
                raise ValueError(f"{name} must be one of {MATRIX_MODES}, got {mode!r}")
            if mode == "frozen" and config.inner_dim != base.embedding.shape[1]:
                raise ValueError(
                    f"a frozen {name} needs inner_dim == the base hidden size "
                    f"({base.embedding.shape[1]}), got {config.inner_dim}"
                )
        if base.embedding.shape != (config.vocab_size, config.emb_dim):
            raise ValueError(
                f"base embedding {tuple(base.embedding.shape)} does not match the speculator's "
                f"vocab_size {config.vocab_size} and emb_dim {config.emb_dim}"
            )
        self.config = config
        self.modes = (head, embedding)
        generator = torch.Generator().manual_seed(seed)
        core = MLPSpeculator(config)
        core.reset_parameters(generator)
        inner, n = config.inner_dim, config.n_predict

        def make_emb() -> Embedding:
            if embedding == "full":
                return FullEmbedding(base.embedding, inner, generator)
            return FactoredEmbedding(base.embedding, inner, embedding == "factored", generator)

        def make_head() -> Head:
            if head == "full":
                return FullHead(base.lm_head, inner, generator)
            return FactoredHead(base.lm_head, inner, head == "factored", generator)

        if config.tie_weights:
            core.emb = nn.ModuleList([make_emb()] * n)
            core.head = nn.ModuleList([make_head()] * n)
        else:
            core.emb = nn.ModuleList(make_emb() for _ in range(n))
            core.head = nn.ModuleList(make_head() for _ in range(n))
        self.core = core

    def heads(self) -> list[Head]:
        return [cast(Head, head) for head in self.core.head]

    def forward(
        self,
        states: torch.Tensor,  # [N, emb_dim]: h_t
        token_ids: torch.Tensor,  # [N, n_predict + 1]: column i is stage i's input token
    ) -> torch.Tensor:  # [n_predict, N, features]
        return self.core(states.unsqueeze(1), token_ids).squeeze(2)

    @torch.no_grad()
    def export(self) -> MLPSpeculator:
        """A plain MLPSpeculator (float32, CPU) computing the same logits over the whole
        vocabulary."""
        out = MLPSpeculator(self.config)
        done: dict[int, torch.Tensor] = {}

        def matrix(module: Embedding | Head) -> torch.Tensor:
            if id(module) not in done:
                done[id(module)] = module.materialize().float().cpu()
            return done[id(module)]

        state = {
            name: t.float().cpu()
            for name, t in self.core.state_dict().items()
            if name.startswith(("proj.", "ln."))
        }
        for i in range(self.config.n_predict):
            state[f"emb.{i}.weight"] = matrix(cast(Embedding, self.core.emb[i]))
            state[f"head.{i}.weight"] = matrix(cast(Head, self.core.head[i]))
        out.load_state_dict(state)
        return out.eval()

    def parameter_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: matrices decay, norm weights and biases do not."""
        trained = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        return [
            {"params": [p for _, p in trained if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in trained if p.dim() < 2], "weight_decay": 0.0},
        ]


class LossOutput(NamedTuple):
    loss: torch.Tensor  # scalar: the sum over heads of each head's mean loss
    head_losses: torch.Tensor  # [n_predict], detached
    head_accuracy: torch.Tensor  # [n_predict]: argmax over candidates == the teacher's top-1


def distillation_loss(
    model: TrainableSpeculator,
    batch: Batch,
    vocab_ids: torch.Tensor,  # [C] int64, sorted: the training vocabulary
) -> LossOutput:
    """Per head, the cross-entropy between the teacher's top-k distribution, renormalised over
    its tokens in `vocab_ids`, and the head's softmax over `vocab_ids`, averaged over the
    positions where the head has a target in `vocab_ids`; summed over heads (fms-fsdp's
    unweighted sum). Accuracy is the share of those positions where the head's argmax over
    `vocab_ids` is the teacher's top-1."""
    features = model(batch.states, batch.token_ids)  # [n, N, F]
    vocab_ids = vocab_ids.to(features.device)
    target_ids = batch.target_ids.contiguous()
    target_index = torch.searchsorted(vocab_ids, target_ids)  # [n, N, k]
    target_index = target_index.clamp_(max=vocab_ids.numel() - 1)
    present = vocab_ids[target_index] == target_ids  # [n, N, k]
    weights = batch.target_logprobs.masked_fill(~present, -torch.inf).softmax(-1)
    weights = weights.nan_to_num(0.0)  # [n, N, k]: rows with no target in vocab_ids are all NaN
    has_target = batch.mask & present.any(-1)  # [n, N]
    losses, accuracy = [], []
    rows: dict[int, torch.Tensor] = {}
    for i, head in enumerate(model.heads()):
        if id(head) not in rows:
            rows[id(head)] = head.rows(vocab_ids)  # [C, F]
        logprobs = (features[i] @ rows[id(head)].t()).log_softmax(-1)  # [N, C]
        ce = -(weights[i] * logprobs.gather(-1, target_index[i])).sum(-1)  # [N]
        mask = has_target[i].to(ce.dtype)
        count = mask.sum().clamp(min=1)
        losses.append((ce * mask).sum() / count)
        hit = ((logprobs.argmax(-1) == target_index[i, :, 0]) & present[i, :, 0]).to(ce.dtype)
        accuracy.append((hit * mask).sum() / count)
    head_losses = torch.stack(losses)
    return LossOutput(head_losses.sum(), head_losses.detach(), torch.stack(accuracy).detach())


def iter_unique_tensors(model: MLPSpeculator) -> Iterator[tuple[str, torch.Tensor]]:
    """The speculator's tensors, each shared one once (under its first name)."""
    for name, p in model.named_parameters():
        yield name, p.detach().contiguous()
