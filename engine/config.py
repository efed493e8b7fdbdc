"""The engine's configuration: plain frozen dataclasses, validated on construction.

No env parsing here: the server maps its `ServerConfig` (TGIS env vars and flags) onto these,
and the offline `LLM` maps its arguments. Importing this module is cheap (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16")
"""The weight and KV dtypes the engine serves, by name."""

CANDIDATE_SELECTIONS = ("nodes", "coverage", "joint")
"""How a proposer picks its candidate paths (see `MLPSpeculator.draft_candidates`)."""

DEFAULT_MEMORY_FRACTION = 0.9
"""Of a CUDA device's memory, what this process plans for (TGIS's CUDA_PROCESS_MEMORY_FRACTION):
the rest absorbs what the profile step cannot see, such as allocator fragmentation as requests
of many lengths come and go, CUDA graph pools and the sampler's per-step buffers."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in the running batch (TGIS MAX_BATCH_SIZE)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step over all requests; longer prompts are prefilled in chunks."""
    max_model_len: int = 4096
    """Most tokens (prompt + output) one request may hold; a prompt must be shorter."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running request gets a token each step"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """An MLP speculator drafting for greedy requests, and the shape of its candidate trees."""

    path: Path | None = None
    """An HF speculator folder or a torch checkpoint file (see `spec_decode.loader`); None when
    the proposer is handed to `build_engine` directly."""
    n_predict: int | None = None
    """Heads of a checkpoint file without config (default: the heads stored)."""
    top_k_tokens_per_head: tuple[int, ...] | None = None
    """Tokens taken per head for the candidate tree (default: the speculator config's)."""
    n_candidates: int | None = None
    """Candidate paths verified per request and step (default: the speculator config's)."""
    candidate_selection: str = "nodes"
    """`nodes` (the drafts of highest path probability, as many as `n_candidates` paths hold, so
    that the policy may verify any number of them), `coverage` (each path adds the most expected
    accepted drafts) or `joint` (fms-extras' highest joint probabilities)."""
    max_batch_size: int = 16
    """Draft only while at most this many requests run."""
    adaptive: bool = True
    """Let a `SpeculationPolicy` choose per step how many candidates pay (possibly none)."""

    def __post_init__(self) -> None:
        for name in ("n_predict", "n_candidates"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k_tokens_per_head is not None and (
            not self.top_k_tokens_per_head or min(self.top_k_tokens_per_head) < 1
        ):
            raise ValueError(
                f"top_k_tokens_per_head must be positive integers, got {self.top_k_tokens_per_head}"
            )
        if self.candidate_selection not in CANDIDATE_SELECTIONS:
            raise ValueError(
                f"candidate_selection must be one of {', '.join(CANDIDATE_SELECTIONS)}, got "
                f"{self.candidate_selection!r}"
            )
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `build_engine` needs to assemble an `LLMEngine`."""

    model_path: Path
    """A Hugging Face model folder of a supported `model_type` (llama, granite, mistral, qwen2:
    `engine.models.config`): config.json, tokenizer, safetensors or .bin weights."""
    dtype: str | None = None
    """Weights and KV dtype (one of DTYPES); default float32 on CPU, and on CUDA the
    checkpoint's half type or float16."""
    device: str = "cpu"
    block_size: int | None = None
    """Tokens per KV block; default: the attention backend's preference."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    """Most tokens per request; default: the model's max positions (capped by the KV pool).
    When set, the KV pool must hold one request of this length."""
    num_kv_blocks: int | None = None
    """KV pool size in blocks; default: `kv_cache_tokens` tokens, else `kv_cache_memory_mb`."""
    kv_cache_tokens: int | None = None
    kv_cache_memory_mb: int | None = None
    """KV pool memory; default: on CPU 512 MiB, on CUDA sized from `memory_fraction`."""
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    """On CUDA, the share of the device's memory this process plans for (see `kv_sizing`)."""
    enable_prefix_caching: bool = True
    """Requests share the KV blocks of identical prompt prefixes."""
    flash_attention: bool = False
    """On CUDA in fp16/bf16 with flash-attn installed, run steps without draft trees on its
    paged kernel (blocks of 256 tokens); otherwise every step runs on the Triton kernel."""
    cuda_graphs: bool = True
    """With the Triton attention backend (the CUDA default), run steps of decode rows and draft
    trees as CUDA graphs captured at start-up for bucketed row counts (`engine.cuda_graphs`)."""
    cuda_graph_max_rows: int = 256
    """The largest such step, in rows (decode rows plus tree nodes), that runs as a graph."""
    cpu_kernels: bool = True
    """On CPU in float32, run the model's glue and attention as fused C kernels (when a C
    compiler is found); False keeps the same maths as ATen ops."""
    speculative: SpeculativeConfig | None = field(default=None)
    tensor_parallel_size: int = 1
    """Processes the model is split over (`engine.parallel`): heads, MLP columns, vocabulary and
    KV heads divided between them; on CUDA one device each."""
    master_addr: str = "localhost"
    """Where the tensor-parallel ranks meet: rank 0's host name or address."""
    master_port: int = 29500
    """... and a free TCP port there."""
    shard_timeout_s: float = 120.0
    """How long a tensor-parallel rank waits for the others within a step before the group
    fails (a rank that hangs)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.shard_timeout_s <= 0:
            raise ValueError(f"shard_timeout_s must be > 0, got {self.shard_timeout_s}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb < 1:
            raise ValueError(f"kv_cache_memory_mb must be >= 1, got {self.kv_cache_memory_mb}")
        if self.cuda_graph_max_rows < 1:
            raise ValueError(f"cuda_graph_max_rows must be >= 1, got {self.cuda_graph_max_rows}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
