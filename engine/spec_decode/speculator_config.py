"""The configuration of an MLP speculator: the fields of its HF `mlp_speculator` config.json,
read, checked and written (`MLPSpeculatorConfig`), and the draft vocabulary's file name."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.spec_decode.candidates import check_tree_shape

MODEL_TYPE = "mlp_speculator"
DRAFT_VOCABULARY_FILE = "draft_vocabulary.json"


def default_top_k_tokens_per_head(n_predict: int) -> tuple[int, ...]:
    """[5, 3, 2] for three heads (the published default), extended with 2s."""
    return (5, 3, 2, *([2] * max(0, n_predict - 3)))[:n_predict]


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    """The fields of an HF `mlp_speculator` config.json (`hidden_size` is read as `emb_dim`;
    `inner_dim` 0 means `emb_dim`)."""

    vocab_size: int
    emb_dim: int
    inner_dim: int = 0
    n_predict: int = 3
    top_k_tokens_per_head: tuple[int, ...] = ()
    n_candidates: int = 5
    tie_weights: bool = False
    scale_input: bool = False

    def __post_init__(self) -> None:
        if self.inner_dim == 0:
            object.__setattr__(self, "inner_dim", self.emb_dim)
        if not self.top_k_tokens_per_head:
            object.__setattr__(
                self, "top_k_tokens_per_head", default_top_k_tokens_per_head(self.n_predict)
            )
        object.__setattr__(self, "top_k_tokens_per_head", tuple(self.top_k_tokens_per_head))
        for name in ("vocab_size", "emb_dim", "inner_dim", "n_predict", "n_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculator {name} must be positive, got {getattr(self, name)}")
        check_tree_shape(self.n_predict, self.top_k_tokens_per_head, self.n_candidates)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> MLPSpeculatorConfig:
        try:
            emb_dim = int(cfg["emb_dim"] if "emb_dim" in cfg else cfg["hidden_size"])
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                emb_dim=emb_dim,
                inner_dim=int(cfg.get("inner_dim", 0)),
                n_predict=int(cfg.get("n_predict", 3)),
                top_k_tokens_per_head=tuple(cfg.get("top_k_tokens_per_head") or ()),
                n_candidates=int(cfg.get("n_candidates", 5)),
                tie_weights=bool(cfg.get("tie_weights", False)),
                scale_input=bool(cfg.get("scale_input", False)),
            )
        except KeyError as e:
            raise ValueError(f"speculator config has no {e.args[0]!r}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> MLPSpeculatorConfig:
        path = Path(folder) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: unreadable speculator config ({e})") from e
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(
                f"{path}: model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}"
            )
        try:
            return cls.from_dict(cfg)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The HF config.json content (as published accelerators write it)."""
        d = asdict(self)
        d["top_k_tokens_per_head"] = list(self.top_k_tokens_per_head)
        return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": MODEL_TYPE, **d}
