"""The models the GPU check writes on the spot (tiny random Llamas, 13B-shaped configs with
random weights), transformers' greedy references and the verdict on a difference."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu_check.report import BOS_ID, EOS_ID, FINAL_NORM_SCALE

if TYPE_CHECKING:
    from engine.core import LLMEngine
    from engine.spec_decode.tree import DraftTree


@dataclass(frozen=True)
class TinyLlama:
    name: str
    seed: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    vocab_size: int = 1024


TINY_MODELS = (
    TinyLlama("tiny-mha-untied", 12, 128, 2, 4, 4, 256, False),
    TinyLlama("tiny-gqa-tied", 1, 256, 4, 8, 2, 512, True),
)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `<unk> <s> </s> w3 ... w{vocab-1}` (split on whitespace): no
    hub download, and any text of `w<i>` words maps to known ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab |= {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.model_max_length = 4096
    fast.save_pretrained(str(folder))


def write_tiny_llama(folder: Path, spec: TinyLlama) -> Any:
    """A random float32 Llama folder (as tools/prepare_models writes its tiny ones: larger-than-
    default init so that greedy outputs vary and top-2 logits rarely tie); returns the
    transformers model (float32, CPU)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1:
                # The final norm sets the logits' scale: top logits around 10-20, large enough
                # for clear top-2 gaps, small enough for float16 steps of 1/128 there.
                scale = FINAL_NORM_SCALE if name == "model.norm.weight" else 1.0
                param.copy_(scale * (1.0 + 0.1 * noise))
            elif "embed_tokens" in name:
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    # Both config spellings (transformers 4's rope_theta, 5's rope_parameters), as
    # tools/prepare_models does, so that any reader agrees.
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    cfg["rope_parameters"] = {**rope, "rope_theta": theta}
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_tokenizer(folder, spec.vocab_size)
    return model


def prompt_ids(vocab_size: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        [BOS_ID, *torch.randint(3, vocab_size, (n - 1,), generator=gen).tolist()] for n in lengths
    ]


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[Any]  # [vocab] float32 CPU tensors, one per generated token


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, device: str) -> Reference:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=EOS_ID,
            eos_token_id=EOS_ID,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Reference(tokens, [step[0].float().cpu() for step in out.logits])


def judge(ours: list[int], ref: Reference, near_tie: float) -> tuple[str, float | None]:
    """("same", None) when identical; ("flip", gap) when they first differ where transformers'
    top-2 logits are within `near_tie` and ours is one of them; ("bad", gap) otherwise (gap None
    when the lengths differ without a differing token)."""
    n = min(len(ours), len(ref.token_ids))
    first = next((i for i in range(n) if ours[i] != ref.token_ids[i]), None)
    if first is None:
        return ("same", None) if len(ours) == len(ref.token_ids) else ("bad", None)
    top2 = ref.logits[first].topk(2)
    gap = float(top2.values[0] - top2.values[1])
    ok = gap < near_tie and ours[first] in top2.indices.tolist()
    return ("flip" if ok else "bad"), gap


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], int, int]:
    """Greedy outputs per prompt, the number of speculative request-steps and the drafts they
    accepted."""
    from engine.sampling.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        tokens[f"r{i}"] = []
    spec_steps = accepted = 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.draft_depth:
                spec_steps += 1
                accepted += out.num_accepted_tokens
    return [tokens[f"r{i}"] for i in range(len(prompts))], spec_steps, accepted


SPEED_13B = {
    "vocab_size": 32000,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
}
SPEED_SMALL = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def write_llama_config(folder: Path, shape: dict[str, int], dtype: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


@contextmanager
def random_weights() -> Iterator[None]:
    """Build ModelRunners whose weights are random instead of loaded.

    Honest about what it skips: `ModelRunner.__init__` builds the model exactly as in serving
    (`LlamaModel`, the same Linear layers, dtype, device and attention backend), then calls
    `engine.model_runner.load_weights(model, folder)`; only that call is replaced, by a fill of
    every parameter in place on the device (linear weights ~ N(0, 0.02), norms 1). Step times
    do not depend on the weights' values, and a 26 GB checkpoint need not be written or read.
    Everything after loading (KV sizing by a profiled step, the pool, every forward pass) is
    the engine's own code."""
    import torch

    import engine.model_runner as model_runner
    from engine.models.llama import LlamaModel

    def fill(model: LlamaModel, folder: object) -> None:
        torch.manual_seed(0)
        with torch.no_grad():
            for linear in model.linears():
                linear.storage.normal_(0.0, 0.02)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)

    original = model_runner.load_weights
    model_runner.load_weights = fill  # type: ignore[assignment]
    try:
        yield
    finally:
        model_runner.load_weights = original


def heap_tree(rows: int) -> DraftTree:
    """A draft tree of `rows` rows (root + rows-1 drafts), node j's parent (j - 1) // 2: as wide
    as it is deep, like the trees a [5,3,2]x5 speculator proposes."""
    from engine.spec_decode.tree import DraftTree

    n = rows - 1
    return DraftTree(
        tuple(100 + j for j in range(1, n + 1)), tuple((j - 1) // 2 for j in range(1, n + 1))
    )
