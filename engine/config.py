"""The engine's configuration: plain frozen dataclasses, validated on construction.

No env parsing here: the server maps its `ServerConfig` (TGIS env vars and flags) onto these,
and the offline `LLM` maps its arguments. Each field's range is declared once, as `Bounds` in the
field's metadata (`bounded`), and checked by `check_bounds`; the server's settings that feed a
field reuse its `Bounds` (`bounds_of`) so that they are refused at start-up under the server's
name. Importing this module is cheap (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
"""The weight and KV dtypes the engine serves, by name."""

QUANTIZATIONS = ("gptq", "int8")
"""Weight quantizations served (TGIS's QUANTIZE values): "gptq" reads a GPTQ checkpoint, "int8"
quantizes a float checkpoint at load (see `engine.quant.scheme`)."""

CANDIDATE_SELECTIONS = ("nodes", "coverage", "joint")
"""How a proposer picks its candidate paths (see `MLPSpeculator.draft_candidates`)."""

KERNEL_PLANS = ("reuse", "retune")
"""What start-up does with the CPU linear layers' kernel plan (`engine.kernels.plan_store`):
"reuse" installs the plan stored for this CPU, model and build (timing and storing one where
none is); "retune" times the kernels again and replaces the stored plan."""

DEFAULT_MEMORY_FRACTION = 0.9
"""Of a CUDA device's memory, what this process plans for (TGIS's CUDA_PROCESS_MEMORY_FRACTION):
the rest absorbs what the profile step cannot see, such as allocator fragmentation as requests
of many lengths come and go, CUDA graph pools and the sampler's per-step buffers."""


@dataclass(frozen=True)
class Bounds:
    """The values a setting accepts: numbers from `low` (excluded when `low_open`) up to `high`,
    or one of `choices`; with `each`, a non-empty tuple of such values. None (unset) is always
    accepted."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    each: bool = False

    def __str__(self) -> str:
        return f"a non-empty list of values {self.range}" if self.each else self.range

    @property
    def range(self) -> str:
        """The values (each value, with `each`) accepted: ">= 1", "in (0, 1]", "one of a, b"."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.low is None:
            return f"<= {self.high}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"

    def holds(self, value: Any) -> bool:
        """Whether `value` is accepted."""
        if value is None:
            return True
        if self.each:
            return isinstance(value, tuple) and bool(value) and all(map(self._holds, value))
        return self._holds(value)

    def _holds(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above and (self.high is None or value <= self.high)  # NaN is neither

    def check(self, name: str, value: Any) -> None:
        """ValueError ("`name` must be ..., got `value`") unless `value` is accepted."""
        if not self.holds(value):
            raise ValueError(f"{name} must be {self}, got {value!r}")


def bounded(bounds: Bounds) -> dict[str, Bounds]:
    """A field's metadata declaring its `bounds`."""
    return {"bounds": bounds}


def bounds_of(config_class: type, name: str) -> Bounds:
    """The `Bounds` declared for field `name` of the dataclass `config_class`."""
    (declared,) = (f for f in fields(config_class) if f.name == name)
    bounds: Bounds = declared.metadata["bounds"]
    return bounds


def check_bounds(config: Any) -> None:
    """ValueError naming the first field of the dataclass instance `config` out of its
    declared `Bounds`."""
    for f in fields(config):
        if "bounds" in f.metadata:
            f.metadata["bounds"].check(f.name, getattr(config, f.name))


def check_token_budget(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    names: tuple[str, str] = ("max_num_seqs", "max_num_batched_tokens"),
) -> None:
    """ValueError unless a step's token budget gives every running request a token: the rule
    between `SchedulerConfig`'s two limits, reported under `names` (the caller's own for them)."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"{names[1]} ({max_num_batched_tokens}) must be >= {names[0]} ({max_num_seqs}) so "
            "that every running request gets a token each step"
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata=bounded(Bounds(low=1)))
    """Most requests in the running batch (TGIS MAX_BATCH_SIZE)."""
    max_num_batched_tokens: int = field(default=2048, metadata=bounded(Bounds(low=1)))
    """Token budget of one step over all requests (at least `max_num_seqs`: `check_token_budget`);
    longer prompts are prefilled in chunks."""
    max_model_len: int = field(default=4096, metadata=bounded(Bounds(low=1)))
    """Most tokens (prompt + output) one request may hold; a prompt must be shorter."""

    def __post_init__(self) -> None:
        check_bounds(self)
        check_token_budget(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass(frozen=True)
class SpeculativeConfig:
    """An MLP speculator drafting for greedy requests, and the shape of its candidate trees."""

    path: Path | None = None
    """An HF speculator folder or a torch checkpoint file (see `spec_decode.loader`); None when
    the proposer is handed to `build_engine` directly."""
    n_predict: int | None = field(default=None, metadata=bounded(Bounds(low=1)))
    """Heads of a checkpoint file without config (default: the heads stored)."""
    top_k_tokens_per_head: tuple[int, ...] | None = field(
        default=None, metadata=bounded(Bounds(low=1, each=True))
    )
    """Tokens taken per head for the candidate tree (default: the speculator config's)."""
    n_candidates: int | None = field(default=None, metadata=bounded(Bounds(low=1)))
    """Candidate paths verified per request and step (default: the speculator config's)."""
    candidate_selection: str = field(
        default="nodes", metadata=bounded(Bounds(choices=CANDIDATE_SELECTIONS))
    )
    """`nodes` (the drafts of highest path probability, as many as `n_candidates` paths hold, so
    that the policy may verify any number of them), `coverage` (each path adds the most expected
    accepted drafts) or `joint` (fms-extras' highest joint probabilities)."""
    max_batch_size: int = field(default=16, metadata=bounded(Bounds(low=0)))
    """Draft only while at most this many requests run."""
    adaptive: bool = True
    """Let a `SpeculationPolicy` choose per step how many candidates pay (possibly none)."""

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `build_engine` needs to assemble an `LLMEngine`."""

    model_path: Path
    """A Hugging Face model folder of a supported `model_type` (llama, granite, mistral, qwen2:
    `engine.models.config`): config.json, tokenizer, safetensors or .bin weights."""
    dtype: str | None = field(default=None, metadata=bounded(Bounds(choices=DTYPES)))
    """Weights and KV dtype (one of DTYPES); default float32 on CPU, and on CUDA the
    checkpoint's half type or float16."""
    device: str = "cpu"
    quantization: str | None = field(default=None, metadata=bounded(Bounds(choices=QUANTIZATIONS)))
    """The decoder layers' weight quantization (one of QUANTIZATIONS); None: what the checkpoint
    declares (GPTQ), else none. A value the checkpoint contradicts stops start-up."""
    block_size: int | None = None
    """Tokens per KV block; default: the attention backend's preference."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    """The scheduler's limits (`SchedulerConfig`, which checks them)."""
    max_model_len: int | None = field(default=None, metadata=bounded(Bounds(low=2)))
    """Most tokens per request; default: the model's max positions (capped by the KV pool).
    When set, the KV pool must hold one request of this length."""
    num_kv_blocks: int | None = field(default=None, metadata=bounded(Bounds(low=2)))
    """KV pool size in blocks; default: `kv_cache_tokens` tokens, else `kv_cache_memory_mb`."""
    kv_cache_tokens: int | None = field(default=None, metadata=bounded(Bounds(low=1)))
    kv_cache_memory_mb: int | None = field(default=None, metadata=bounded(Bounds(low=1)))
    """KV pool memory; default: on CPU 512 MiB, on CUDA sized from `memory_fraction`."""
    memory_fraction: float = field(
        default=DEFAULT_MEMORY_FRACTION, metadata=bounded(Bounds(low=0, low_open=True, high=1))
    )
    """On CUDA, the share of the device's memory this process plans for (see `kv_sizing`)."""
    enable_prefix_caching: bool = True
    """Requests share the KV blocks of identical prompt prefixes."""
    flash_attention: bool = False
    """On CUDA in fp16/bf16 with flash-attn installed, run steps without draft trees on its
    paged kernel (blocks of 256 tokens); otherwise every step runs on the Triton kernel."""
    cuda_graphs: bool = True
    """With the Triton attention backend (the CUDA default) and one shard, run steps of decode
    rows and draft trees as CUDA graphs captured at start-up for bucketed row counts
    (`engine.cuda_graphs.ROW_COUNTS`) up to min(`cuda_graph_max_rows`,
    `max_num_batched_tokens`); larger steps run eagerly."""
    cuda_graph_max_rows: int = field(default=256, metadata=bounded(Bounds(low=1)))
    """The largest such step, in rows (decode rows plus tree nodes), that runs as a graph."""
    cpu_kernels: bool = True
    """On CPU in float32, run the model's glue and attention as fused C kernels (when a C
    compiler is found); False keeps the same maths as ATen ops."""
    kernel_plan: str = field(default="reuse", metadata=bounded(Bounds(choices=KERNEL_PLANS)))
    """On CPU, whether start-up reuses the stored kernel plan or times the kernels again (one of
    `KERNEL_PLANS`)."""
    speculative: SpeculativeConfig | None = field(default=None)
    tensor_parallel_size: int = field(default=1, metadata=bounded(Bounds(low=1)))
    """Processes the model is split over (`engine.parallel`): heads, MLP columns, vocabulary and
    KV heads divided between them; on CUDA one device each."""
    master_addr: str = "localhost"
    """Where the tensor-parallel ranks meet: rank 0's host name or address."""
    master_port: int = field(default=29500, metadata=bounded(Bounds(low=1, high=65535)))
    """... and a free TCP port there."""
    shard_timeout_s: float = field(default=120.0, metadata=bounded(Bounds(low=0, low_open=True)))
    """How long a tensor-parallel rank waits for the others within a step before the group
    fails (a rank that hangs)."""

    def __post_init__(self) -> None:
        check_bounds(self)
