"""Server configuration: one frozen dataclass, read from TGIS's env vars and CLI flags.

Every field has a default and a docstring; each is settable as env var `NAME` or flag `--name`
(lower case, dashes), the flag winning: `server.cli` reads them (`from_env_and_args`).
Importing this module is cheap (no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import DEFAULT_MEMORY_FRACTION
from engine.paths import default_model_path
from server.config_checks import check_config, parse_top_k
from server.dtypes import canonical_dtype

DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024 - 64 * 1024
"""64 KiB below gRPC's default receive limit (4 MiB): a client with default settings would fail
on a larger message with RESOURCE_EXHAUSTED and no explanation."""


def _meta(
    doc: str,
    env: tuple[str, ...] = (),
    switch: bool = False,
    flags: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """A field's metadata: its help text, env var names (default: the name in upper case), whether
    it is a switch, extra flags, and the parser of its raw string (default: by type)."""
    return {"doc": doc, "env": env, "switch": switch, "flags": flags, "parse": parse}


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings. `from_env_and_args` builds it; `__post_init__` validates it
    (`server.config_checks`).

    Where the model and speculator are, and values that depend on the model
    (`max_sequence_length` when unset), are resolved by `server.model_files`; the effective
    max_new_tokens is `effective_max_new_tokens`.
    """

    model_name: str = field(
        default_factory=lambda: str(default_model_path()),
        metadata=_meta(
            "Model folder (absolute or relative path), the name of a prepared model under "
            "$SPECSERVE_HOME/models, or a Hugging Face Hub id (org/name) found in the local HF "
            "cache (HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; never "
            "downloaded)."
        ),
    )
    revision: str | None = field(
        default=None,
        metadata=_meta(
            "Revision of a Hub id model_name: a branch or tag (resolved through the cache's "
            "refs/<revision>) or a commit hash (default: main); ignored for a folder."
        ),
    )
    dtype: str | None = field(
        default=None,
        metadata=_meta(
            "Weights/KV dtype, a torch dtype name: float16 (half, fp16), bfloat16 (bf16) or "
            "float32 (float, fp32); int8 is accepted with a warning and ignored (default: float32 "
            "on CPU; on CUDA bfloat16 for a bfloat16 checkpoint, else float16).",
            env=("DTYPE_STR", "DTYPE"),
            flags=("--dtype-str",),
            parse=canonical_dtype,
        ),
    )
    device: str = field(default="cpu", metadata=_meta("Torch device, e.g. cpu or cuda:0."))
    num_shard: int = field(
        default=1,
        metadata=_meta(
            "Processes the model is split over by tensor parallelism, one CUDA device each on "
            "CUDA (rank r on cuda:r of CUDA_VISIBLE_DEVICES); must divide the attention heads "
            "and the MLP width.",
            env=("NUM_SHARD", "NUM_GPUS"),
        ),
    )
    master_addr: str = field(
        default="localhost",
        metadata=_meta("Host where the tensor-parallel ranks meet (rank 0's)."),
    )
    master_port: int = field(
        default=29500,
        metadata=_meta("Free TCP port on master_addr where the tensor-parallel ranks meet."),
    )
    shard_timeout_s: float = field(
        default=120.0,
        metadata=_meta(
            "Seconds a tensor-parallel rank waits for the others within a step; a rank that "
            "hangs longer stops the server (exit code 1).",
            env=("SHARD_TIMEOUT_SECONDS",),
        ),
    )
    max_sequence_length: int | None = field(
        default=None,
        metadata=_meta(
            "Most tokens (input + generated) per request; default: the model config's "
            "max_position_embeddings (or similar), else 2048."
        ),
    )
    max_new_tokens: int = field(
        default=1024,
        metadata=_meta("Server max of a request's max_new_tokens (clamped to seq len - 1)."),
    )
    max_batch_size: int = field(
        default=32,
        metadata=_meta(
            "Most requests in the running batch (TGIS's default is 12); more requests per step "
            "trade per-token latency for throughput."
        ),
    )
    max_batched_tokens: int = field(
        default=2048,
        metadata=_meta("Token budget of one engine step; longer prompts prefill in chunks."),
    )
    max_concurrent_requests: int = field(
        default=512,
        metadata=_meta("gRPC admission limit; a batch of n inputs takes n permits."),
    )
    max_response_bytes: int = field(
        default=DEFAULT_MAX_RESPONSE_BYTES,
        metadata=_meta(
            "Largest gRPC response message (bytes); a request whose response would be larger "
            "fails with RESOURCE_EXHAUSTED. Default: 64 KiB below gRPC's 4 MiB receive limit."
        ),
    )
    kv_cache_blocks: int | None = field(
        default=None,
        metadata=_meta(
            "Number of KV cache blocks; default: sized from kv_cache_memory_mb, else from "
            "device memory.",
            env=("KV_CACHE_BLOCKS", "KV_CACHE_MANAGER_NUM_GPU_BLOCKS"),
        ),
    )
    kv_cache_memory_mb: int | None = field(
        default=None,
        metadata=_meta(
            "KV cache memory (MiB) when kv_cache_blocks is unset; default: 512 on CPU, on CUDA "
            "what cuda_process_memory_fraction leaves after the weights and a worst-case step."
        ),
    )
    cuda_process_memory_fraction: float = field(
        default=DEFAULT_MEMORY_FRACTION,
        metadata=_meta(
            "Share of the CUDA device's memory this server plans for, in (0, 1]; the KV pool "
            "gets it minus the weights and a profiled worst-case step.",
            flags=("-c",),
        ),
    )
    grpc_port: int = field(
        default=8033, metadata=_meta("gRPC port (bound on 0.0.0.0).", flags=("-g",))
    )
    port: int = field(
        default=3000, metadata=_meta("HTTP port for /health and /metrics.", flags=("-p",))
    )
    output_special_tokens: bool = field(
        default=False,
        metadata=_meta(
            "Keep special tokens in output text (a final EOS is still dropped).", switch=True
        ),
    )
    default_include_stop_seqs: bool = field(
        default=True,
        metadata=_meta("include_stop_sequence when a request leaves it unset (true/false)."),
    )
    shutdown_grace_s: float = field(
        default=5.0,
        metadata=_meta(
            "On SIGTERM, seconds in-flight requests get to finish before they are cancelled.",
            env=("SHUTDOWN_GRACE_SECONDS",),
        ),
    )
    flash_attention: bool = field(
        default=False,
        metadata=_meta(
            "TGIS switch (true/false), accepted and validated: attention always runs on the "
            "paged KV cache, on the Triton kernel on CUDA; true: flash-attn's kernel for steps "
            "without draft trees, when it is installed and the dtype is float16 or bfloat16."
        ),
    )
    no_cuda_graphs: bool = field(
        default=False,
        metadata=_meta(
            "Run every step eagerly; by default decode steps on CUDA replay CUDA graphs captured "
            "at start-up for batch sizes up to max_batch_size.",
            switch=True,
        ),
    )
    paged_attention: bool = field(
        default=False,
        metadata=_meta(
            "TGIS switch (true/false), accepted and validated: attention is always paged here."
        ),
    )
    tls_cert_path: str | None = field(
        default=None,
        metadata=_meta("PEM certificate (chain) of the gRPC server; enables TLS with the key."),
    )
    tls_key_path: str | None = field(
        default=None, metadata=_meta("PEM private key of tls_cert_path.")
    )
    tls_client_ca_cert_path: str | None = field(
        default=None,
        metadata=_meta(
            "PEM CA bundle: gRPC clients must present a certificate signed by it (mTLS); "
            "requires the cert and key."
        ),
    )
    speculator_path: str | None = field(
        default=None,
        metadata=_meta(
            "MLP speculator: an HF folder (config.json with model_type mlp_speculator) or a "
            "torch checkpoint file holding its state dict (or {'model_state': ...}).",
            env=("SPECULATOR_PATH", "SPECULATOR_NAME"),
        ),
    )
    speculator_revision: str | None = field(
        default=None,
        metadata=_meta(
            "Revision of a Hub id speculator_path (SPECULATOR_NAME), as revision for model_name."
        ),
    )
    speculator_n_predict: int | None = field(
        default=None,
        metadata=_meta(
            "Heads of a speculator checkpoint file without config (default: heads stored)."
        ),
    )
    speculator_n_candidates: int | None = field(
        default=None,
        metadata=_meta(
            "Candidate paths verified per request and step (default: the speculator config's).",
            env=("SPECULATOR_N_CANDIDATES", "SPECULATOR_NUM_CANDIDATES"),
        ),
    )
    speculator_top_k_tokens_per_head: str | None = field(
        default=None,
        metadata=_meta(
            "Comma list of tokens taken per head for the candidate tree, one per head "
            "(default: the speculator config's).",
            env=("SPECULATOR_TOP_K_TOKENS_PER_HEAD", "SPECULATOR_THRESHES"),
        ),
    )
    speculator_candidate_selection: str = field(
        default="nodes",
        metadata=_meta(
            "How candidates are picked from the tree: nodes (the drafts of highest path "
            "probability, as many as the candidate paths hold; the server verifies as many of "
            "them as pay), coverage (paths, each adding the most expected accepted drafts) or "
            "joint (paths of highest probability, as fms-extras)."
        ),
    )
    speculator_max_batch_size: int = field(
        default=16,
        metadata=_meta("Speculate only while at most this many requests run."),
    )
    prefix_caching: bool = field(
        default=True,
        metadata=_meta(
            "Share the KV blocks of identical prompt prefixes (e.g. a system prompt) between "
            "requests instead of recomputing them (true/false)."
        ),
    )
    prefix_store_path: str | None = field(
        default=None,
        metadata=_meta(
            "Folder of prompt-tuning prefixes, TGIS's prompt store: a request's prefix_id names "
            "<id>/decoder.pt or <id>.pt (a [virtual tokens, hidden] tensor) or a PEFT "
            "prompt-tuning folder <id>/ (adapter_model.safetensors or .bin); the id may use "
            "letters, digits, _, - and / (unset: every prefix_id is not found)."
        ),
    )
    prompt_cache_size_mb: int = field(
        default=512,
        metadata=_meta(
            "Memory for loaded prompt prefixes (in the model's dtype on its device), least "
            "recently used evicted first; a prefix larger than this is refused, as TGIS does."
        ),
    )
    speculator_adaptive: bool = field(
        default=True,
        metadata=_meta(
            "Choose per step, from measured step times and acceptance, how many candidates "
            "pay (possibly none); false: always verify the whole tree (true/false)."
        ),
    )
    json_output: bool = field(
        default=False,
        metadata=_meta(
            "Log one JSON object per line (timestamp, level, logger, message, exception).",
            switch=True,
        ),
    )
    otlp_endpoint: str | None = field(
        default=None,
        metadata=_meta(
            "OpenTelemetry collector (OTLP over gRPC), e.g. http://otel-collector:4317 "
            "(https:// or no scheme: TLS): one span per RPC and per generated sequence. Unset: "
            "no tracing."
        ),
    )
    otlp_service_name: str | None = field(
        default=None,
        metadata=_meta("service.name of the spans (default: OTEL_SERVICE_NAME, else specserve)."),
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        check_config(self)

    def speculator_top_k(self) -> tuple[int, ...] | None:
        """`speculator_top_k_tokens_per_head` parsed (`parse_top_k`)."""
        return parse_top_k(self.speculator_top_k_tokens_per_head)

    @property
    def tls_enabled(self) -> bool:
        """True when the gRPC port serves TLS (cert and key are set)."""
        return self.tls_cert_path is not None

    def effective_max_new_tokens(self, max_sequence_length: int) -> int:
        """min(max_new_tokens, max_sequence_length - 1)."""
        return min(self.max_new_tokens, max_sequence_length - 1)

    @classmethod
    def from_env_and_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Build from `env` (default os.environ) overridden by the flags in `argv` (default
        sys.argv[1:]). Raises ValueError for unknown flags and for unparsable or invalid values,
        naming the field; SystemExit for --help. TGIS launcher flags without effect here are
        accepted (`server.cli.parse_launcher` also returns their warnings)."""
        from server.cli import config_from_env_and_args

        return config_from_env_and_args(argv, env)

    def describe(self) -> str:
        """One `name=value` line per field, for the startup log."""
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())
