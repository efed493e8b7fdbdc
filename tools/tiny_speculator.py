"""Write random-weight MLP speculator checkpoints in the published accelerator format.

    python -m tools.tiny_speculator OUT_DIR --base MODEL_DIR [--n-predict 3] [--inner-dim 64]
        [--tie-weights] [--scale-input] [--seed 0] [--format safetensors|bin|sharded|torch-file]

The folder gets `config.json` (model_type mlp_speculator) and the weights with the HF wrapper's
`speculator.` prefix; tied speculators store each shared tensor once, as published ones do.
`torch-file` writes `speculator.pth` holding `{"model_state": state}` without prefix and no
config (TGIS's first speculative branch).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.llama import LlamaConfig
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.speculator_config import MLPSpeculatorConfig

FORMATS = ("safetensors", "bin", "sharded", "torch-file")


def unique_state_dict(model: MLPSpeculator) -> dict[str, torch.Tensor]:
    """The speculator's tensors, each shared one once (under its first name)."""
    return {name: p.detach().contiguous() for name, p in model.named_parameters()}


def write_tiny_speculator(
    out_dir: str | Path,
    base_model: str | Path,
    *,
    n_predict: int = 3,
    inner_dim: int = 64,
    tie_weights: bool = False,
    scale_input: bool = False,
    top_k_tokens_per_head: Sequence[int] = (),
    n_candidates: int = 5,
    seed: int = 0,
    fmt: str = "safetensors",
    emb_dim: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Write a speculator for `base_model` (its hidden size and vocab unless `emb_dim` or
    `vocab_size` override them) and return the path SPECULATOR_PATH should name."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    base = LlamaConfig.from_folder(base_model)
    config = MLPSpeculatorConfig(
        vocab_size=vocab_size or base.vocab_size,
        emb_dim=emb_dim or base.hidden_size,
        inner_dim=inner_dim,
        n_predict=n_predict,
        top_k_tokens_per_head=tuple(top_k_tokens_per_head),
        n_candidates=n_candidates,
        tie_weights=tie_weights,
        scale_input=scale_input,
    )
    model = MLPSpeculator(config)
    generator = torch.Generator().manual_seed(seed)
    model.reset_parameters(generator)
    with torch.no_grad():  # non-trivial norms, so that a loader mixing them up is caught
        for name, p in model.named_parameters():
            if name.startswith("ln."):
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = unique_state_dict(model)
    if fmt == "torch-file":
        torch.save({"model_state": state, "step": 0}, out / "speculator.pth")
        return out / "speculator.pth"
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    prefixed = {f"speculator.{k}": v for k, v in state.items()}
    if fmt == "safetensors":
        save_file(prefixed, str(out / "model.safetensors"), metadata={"format": "pt"})
    elif fmt == "bin":
        torch.save(prefixed, out / "pytorch_model.bin")
    else:
        names = sorted(prefixed)
        shards = [names[: len(names) // 2], names[len(names) // 2 :]]
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: prefixed[k] for k in shard}, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--base", required=True, help="the base model's HF folder")
    parser.add_argument("--n-predict", type=int, default=3)
    parser.add_argument("--inner-dim", type=int, default=64)
    parser.add_argument("--tie-weights", action="store_true")
    parser.add_argument("--scale-input", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=FORMATS, default="safetensors")
    args = parser.parse_args(argv)
    path = write_tiny_speculator(
        args.out_dir,
        args.base,
        n_predict=args.n_predict,
        inner_dim=args.inner_dim,
        tie_weights=args.tie_weights,
        scale_input=args.scale_input,
        seed=args.seed,
        fmt=args.format,
    )
    print(path)


if __name__ == "__main__":
    main()
