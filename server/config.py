"""Server configuration: one frozen dataclass whose fields declare TGIS's settings.

Each field is one setting, declared once in its metadata (`server.setting.Setting`): env vars,
flags, type, bounds and help. `from_env_and_args` reads env vars and flags (a flag wins),
`__post_init__` checks the values, `--help` and docs/configuration.md's table are made from
the same declaration (`server.setting`). Settings that feed the engine take their bounds from
the engine's field (`engine.config.bounds_of`), so each range is declared once. Importing this
module is cheap (no torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.config import (
    DEFAULT_MEMORY_FRACTION,
    Bounds,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    bounds_of,
    check_bounds,
    check_token_budget,
)
from engine.paths import default_model_path
from server.dtypes import canonical_dtype
from server.setting import (
    BOOLEAN,
    INT_LIST,
    INTEGER,
    NUMBER,
    SWITCH,
    TEXT,
    Kind,
    build_parser,
    read_settings,
    setting,
)

DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024 - 64 * 1024
"""64 KiB below gRPC's default receive limit (4 MiB): a client with default settings would fail
on a larger message with RESOURCE_EXHAUSTED and no explanation."""

PORT = Bounds(low=0, high=65535)
DTYPE = Kind("dtype name", canonical_dtype)

IGNORED_LAUNCHER_FLAGS = {
    "--deployment-framework": "the engine is specserve's own (paged attention, continuous "
    "batching)",
    "--shard-uds-path": "shard processes meet over torch.distributed at MASTER_ADDR:MASTER_PORT",
    "--max-waiting-tokens": "waiting requests join the running batch at every step",
    "--max-prefill-padding": "batches are not padded",
    "--batch-safety-margin": "the KV pool is sized by CUDA_PROCESS_MEMORY_FRACTION, "
    "KV_CACHE_MEMORY_MB or KV_CACHE_BLOCKS",
    "--max-batch-weight": "obsolete in TGIS too; admission counts KV blocks",
    "--max-prefill-weight": "obsolete in TGIS too; long prompts prefill in chunks of "
    "MAX_BATCHED_TOKENS",
}
"""TGIS launcher flags that are accepted, with their env vars, and have no effect here:
flag -> why. Each one given is reported as a warning."""


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings; `__post_init__` checks them (each field's bounds, and the rules
    between fields). Where the model and speculator are, and values that depend on the model
    (`max_sequence_length` when unset), are resolved by `server.model_files`."""

    model_name: str = setting(
        lambda: str(default_model_path()),
        "Model folder (absolute or relative path), the name of a prepared model under "
        "$SPECSERVE_HOME/models, or a Hub id (org/name) found in the local Hugging Face "
        "cache (HF_HUB_CACHE); never downloaded. A missing model stops start-up with a "
        "message naming every place looked at.",
        TEXT,
        default_help="$SPECSERVE_HOME/models/SmolLM2-135M-Instruct",
    )
    revision: str | None = setting(
        None,
        "Revision of a Hub id MODEL_NAME: a branch or tag (the cache's refs/<revision>) or "
        "a commit hash; ignored for a folder.",
        TEXT,
        default_help="main",
    )
    dtype: str | None = setting(
        None,
        "Weights and KV dtype, a torch dtype name: float16 (half, fp16), bfloat16 (bf16) or "
        "float32 (float, fp32); int8 logs a warning and keeps the default.",
        DTYPE,
        env=("DTYPE_STR", "DTYPE"),
        flags=("--dtype-str",),
        default_help="float32 on CPU; on CUDA bfloat16 for a bfloat16 checkpoint, else float16",
        ignored_because="8-bit (bitsandbytes) weights are not supported; weights load in "
        "the default dtype",
    )
    quantize: str | None = setting(
        None,
        "Weight quantization of the decoder layers' projections: gptq (a GPTQ checkpoint, 4 or "
        "8 bits) or int8 (a float checkpoint quantized at load, per output channel). On CPU "
        "their products take int8 activations quantized per row; on CUDA gptq is weight-only. "
        "Embeddings, norms, the LM head and the speculator stay in DTYPE_STR. A value the "
        "checkpoint contradicts, or another TGIS value (bitsandbytes, fp8, ...), stops start-up.",
        TEXT,
        bounds=bounds_of(EngineConfig, "quantization"),
        default_help="gptq when the checkpoint's quantize_config.json or config.json declares "
        "it, else none",
    )
    device: str = setting(
        "cpu", "Torch device, e.g. cpu or cuda:0 (the CUDA image sets cuda).", TEXT
    )
    num_shard: int = setting(
        1,
        "Processes the model is split over by tensor parallelism, one CUDA device each on "
        "CUDA (rank r on cuda:r of CUDA_VISIBLE_DEVICES); must divide the attention heads "
        "and the MLP width.",
        INTEGER,
        env=("NUM_SHARD", "NUM_GPUS"),
        bounds=bounds_of(EngineConfig, "tensor_parallel_size"),
    )
    master_addr: str = setting(
        "localhost", "Host where the tensor-parallel ranks meet (rank 0's).", TEXT
    )
    master_port: int = setting(
        29500,
        "Free TCP port on MASTER_ADDR where the tensor-parallel ranks meet.",
        INTEGER,
        bounds=bounds_of(EngineConfig, "master_port"),
    )
    shard_timeout_s: float = setting(
        120.0,
        "Seconds a tensor-parallel rank waits for the others within a step; a rank that "
        "hangs longer (or dies) stops the server, exit code 1.",
        NUMBER,
        env=("SHARD_TIMEOUT_SECONDS",),
        bounds=bounds_of(EngineConfig, "shard_timeout_s"),
    )
    max_sequence_length: int | None = setting(
        None,
        "Most tokens (input + generated) per request.",
        INTEGER,
        bounds=bounds_of(EngineConfig, "max_model_len"),
        default_help="the model config's max_position_embeddings (or similar), else 2048",
    )
    max_new_tokens: int = setting(
        1024,
        "Server cap on a request's max_new_tokens (at most MAX_SEQUENCE_LENGTH - 1).",
        INTEGER,
        bounds=Bounds(low=1),
    )
    max_batch_size: int = setting(
        32,
        "Most requests in the running batch (TGIS's default is 12); more requests per step "
        "trade per-token latency for throughput.",
        INTEGER,
        bounds=bounds_of(SchedulerConfig, "max_num_seqs"),
    )
    max_batched_tokens: int = setting(
        2048,
        "Token budget of one engine step, at least MAX_BATCH_SIZE; longer prompts prefill "
        "in chunks.",
        INTEGER,
        bounds=bounds_of(SchedulerConfig, "max_num_batched_tokens"),
    )
    max_concurrent_requests: int = setting(
        512,
        "Admission limit across the gRPC and HTTP APIs, one permit per input (Generate and "
        "Tokenize) or choice (HTTP); beyond it RESOURCE_EXHAUSTED (HTTP: 429), Model is "
        "overloaded.",
        INTEGER,
        bounds=Bounds(low=1),
    )
    max_response_bytes: int = setting(
        DEFAULT_MAX_RESPONSE_BYTES,
        "Largest gRPC response message (bytes); a request whose response would be larger "
        "fails with RESOURCE_EXHAUSTED.",
        INTEGER,
        bounds=Bounds(low=1024),
        default_help="4 MiB - 64 KiB, below gRPC's default 4 MiB receive limit",
    )
    kv_cache_blocks: int | None = setting(
        None,
        "KV pool size in blocks.",
        INTEGER,
        env=("KV_CACHE_BLOCKS", "KV_CACHE_MANAGER_NUM_GPU_BLOCKS"),
        bounds=bounds_of(EngineConfig, "num_kv_blocks"),
        default_help="sized from KV_CACHE_MEMORY_MB, else from device memory",
    )
    kv_cache_memory_mb: int | None = setting(
        None,
        "KV pool memory (MiB) when KV_CACHE_BLOCKS is unset.",
        INTEGER,
        bounds=bounds_of(EngineConfig, "kv_cache_memory_mb"),
        default_help="512 on CPU; on CUDA what CUDA_PROCESS_MEMORY_FRACTION leaves after "
        "the weights and a worst-case step",
    )
    cuda_process_memory_fraction: float = setting(
        DEFAULT_MEMORY_FRACTION,
        "Share of the CUDA device's memory this server plans for; the KV pool gets it minus "
        "the weights and a profiled worst-case step.",
        NUMBER,
        flags=("-c",),
        bounds=bounds_of(EngineConfig, "memory_fraction"),
    )
    grpc_port: int = setting(
        8033, "gRPC port, bound on 0.0.0.0.", INTEGER, flags=("-g",), bounds=PORT
    )
    port: int = setting(
        3000,
        "HTTP port for /health, /metrics and the OpenAI-compatible API (/v1/...), bound on "
        "0.0.0.0; plaintext.",
        INTEGER,
        flags=("-p",),
        bounds=PORT,
    )
    http_header_timeout_s: float = setting(
        10.0,
        "Seconds an HTTP connection gets to send a whole request head (from its opening, or "
        "from its previous response); slower ones are closed.",
        NUMBER,
        env=("HTTP_HEADER_TIMEOUT_SECONDS",),
        bounds=Bounds(low=0.1),
    )
    http_body_timeout_s: float = setting(
        30.0,
        "Seconds an HTTP request gets to send its whole body after its head; slower ones "
        "are closed.",
        NUMBER,
        env=("HTTP_BODY_TIMEOUT_SECONDS",),
        bounds=Bounds(low=0.1),
    )
    http_max_connections: int = setting(
        1024,
        "Most open HTTP connections; a connection beyond them is closed at once.",
        INTEGER,
        bounds=Bounds(low=1),
    )
    http_max_body_bytes: int = setting(
        4 * 1024 * 1024,
        "Largest HTTP request body (bytes), as gRPC's default receive limit; a larger one "
        "gets 413.",
        INTEGER,
        bounds=Bounds(low=1024),
        default_help="4 MiB",
    )
    output_special_tokens: bool = setting(
        False, "Keep special tokens in output text (a final EOS is still dropped).", SWITCH
    )
    default_include_stop_seqs: bool = setting(
        True,
        "Include a matched stop sequence in the text when a request leaves "
        "include_stop_sequence unset.",
        BOOLEAN,
    )
    shutdown_grace_s: float = setting(
        5.0,
        "On SIGTERM, seconds in-flight requests get to finish before they are cancelled.",
        NUMBER,
        env=("SHUTDOWN_GRACE_SECONDS",),
        bounds=Bounds(low=0),
    )
    flash_attention: bool = setting(
        False,
        "TGIS switch. Attention always runs on the paged KV cache, on CUDA on the Triton "
        "kernel; true: steps without draft trees run on flash-attn's kernel when it is "
        "installed and the dtype is float16 or bfloat16 (256-token blocks).",
        BOOLEAN,
    )
    no_cuda_graphs: bool = setting(
        False,
        "Run every step eagerly. By default, on CUDA with the Triton attention kernel and "
        "one shard, steps of decode rows and draft trees (at most 64 rows per sequence) "
        "replay CUDA graphs captured at start-up for 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, "
        f"128, 192 and 256 rows, up to min({EngineConfig.cuda_graph_max_rows}, "
        "MAX_BATCHED_TOKENS) rows; larger steps run eagerly.",
        SWITCH,
    )
    kernel_plan: str = setting(
        "reuse",
        "CPU linear layers' kernel plan: reuse installs the plan stored for this CPU, model "
        "and build (timing and storing one where none is, under $SPECSERVE_HOME/kernels); "
        "retune times the kernels again and replaces it.",
        TEXT,
        bounds=bounds_of(EngineConfig, "kernel_plan"),
    )
    paged_attention: bool = setting(
        False, "TGIS switch, accepted: attention is always paged here.", BOOLEAN
    )
    tls_cert_path: str | None = setting(
        None,
        "PEM certificate (chain) of the gRPC server; with TLS_KEY_PATH, enables TLS.",
        TEXT,
        default_help="unset: plaintext",
    )
    tls_key_path: str | None = setting(None, "PEM private key of TLS_CERT_PATH.", TEXT)
    tls_client_ca_cert_path: str | None = setting(
        None,
        "PEM CA bundle: gRPC clients must present a certificate signed by it (mTLS); "
        "requires the cert and key.",
        TEXT,
    )
    speculator_path: str | None = setting(
        None,
        "MLP speculator: an HF folder (config.json with model_type mlp_speculator), a torch "
        "checkpoint file holding its state dict, a name under $SPECSERVE_HOME/speculators, "
        "or a Hub id in the HF cache.",
        TEXT,
        env=("SPECULATOR_PATH", "SPECULATOR_NAME"),
        default_help="unset: no speculation",
    )
    speculator_revision: str | None = setting(
        None,
        "Revision of a Hub id speculator, as REVISION for MODEL_NAME.",
        TEXT,
        default_help="main",
    )
    speculator_n_predict: int | None = setting(
        None,
        "Heads of a speculator checkpoint file without config.",
        INTEGER,
        bounds=bounds_of(SpeculativeConfig, "n_predict"),
        default_help="the heads stored",
    )
    speculator_n_candidates: int | None = setting(
        None,
        "Candidate paths verified per request and step (with nodes selection: the tree "
        "holds as many drafts as they would).",
        INTEGER,
        env=("SPECULATOR_N_CANDIDATES", "SPECULATOR_NUM_CANDIDATES"),
        bounds=bounds_of(SpeculativeConfig, "n_candidates"),
        default_help="the speculator config's",
    )
    speculator_top_k_tokens_per_head: tuple[int, ...] | None = setting(
        None,
        "Tokens taken per head for the candidate tree, one per head.",
        INT_LIST,
        env=("SPECULATOR_TOP_K_TOKENS_PER_HEAD", "SPECULATOR_THRESHES"),
        bounds=bounds_of(SpeculativeConfig, "top_k_tokens_per_head"),
        default_help="the speculator config's",
    )
    speculator_candidate_selection: str = setting(
        "nodes",
        "How candidates are picked from the tree: nodes (the drafts of highest path "
        "probability, as many as the candidate paths hold; the adaptive policy verifies as "
        "many of them as pay), coverage (paths, each adding the most expected accepted "
        "drafts) or joint (paths of highest probability, as fms-extras).",
        TEXT,
        bounds=bounds_of(SpeculativeConfig, "candidate_selection"),
    )
    speculator_max_batch_size: int = setting(
        16,
        "Speculate only while at most this many requests run.",
        INTEGER,
        bounds=bounds_of(SpeculativeConfig, "max_batch_size"),
    )
    speculator_adaptive: bool = setting(
        True,
        "Choose per step, from measured step times and acceptance, how many candidates "
        "pay (possibly none); false: always verify the whole tree.",
        BOOLEAN,
    )
    prefix_caching: bool = setting(
        True,
        "Share the KV blocks of identical prompt prefixes (e.g. a system prompt) between "
        "requests instead of recomputing them: whole computed blocks, kept while free "
        "until reused.",
        BOOLEAN,
    )
    prefix_store_path: str | None = setting(
        None,
        "Folder of prompt-tuning prefixes, TGIS's prompt store: a request's prefix_id names "
        "<id>/decoder.pt or <id>.pt (a [virtual tokens, hidden] tensor) or a PEFT "
        "prompt-tuning folder <id>/ (adapter_model.safetensors or .bin); ids use letters, "
        "digits, _, - and / and stay inside the store (links are followed only inside "
        "it, and only regular files are read). The embeddings go before the "
        "prompt's and count toward the input length (at most half of MAX_SEQUENCE_LENGTH "
        "virtual tokens).",
        TEXT,
        default_help="unset: every prefix_id is not found",
    )
    prompt_cache_size_mb: int = setting(
        512,
        "Memory for loaded prompt prefixes (in the model's dtype on its device), least "
        "recently used evicted first; a prefix larger than this is refused, as TGIS does.",
        INTEGER,
        bounds=Bounds(low=0),
    )
    json_output: bool = setting(
        False,
        "Log one JSON object per line: timestamp, level, logger, message, and exception "
        "(the traceback).",
        SWITCH,
    )
    otlp_endpoint: str | None = setting(
        None,
        "OpenTelemetry collector (OTLP over gRPC), e.g. http://otel-collector:4317 "
        "(https:// or no scheme: TLS): a span per RPC (child of the client's traceparent) "
        "and per generated sequence.",
        TEXT,
        default_help="unset: no tracing",
    )
    otlp_service_name: str | None = setting(
        None, "service.name of the spans.", TEXT, default_help="OTEL_SERVICE_NAME, else specserve"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        check_bounds(self)
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        names = ("max_batch_size", "max_batched_tokens")
        check_token_budget(self.max_batch_size, self.max_batched_tokens, names)
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("tls: must provide both cert and key")
        if self.tls_client_ca_cert_path is not None and self.tls_cert_path is None:
            raise ValueError("tls: cannot provide client ca cert without keypair")

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
        naming the field; SystemExit for --help. The TGIS launcher flags without effect here are
        accepted (`server.cli.parse_launcher` also returns their warnings)."""
        env = os.environ if env is None else env
        values, _ = read_settings(arg_parser(cls), cls, IGNORED_LAUNCHER_FLAGS, argv, env)
        return cls(**values)

    def describe(self) -> str:
        """One `name=value` line per field, for the startup log."""
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def arg_parser(config_class: type = ServerConfig) -> argparse.ArgumentParser:
    """The command line: a flag per setting of `config_class`, and the TGIS launcher flags
    accepted without effect."""
    return build_parser(
        config_class,
        IGNORED_LAUNCHER_FLAGS,
        prog="specserve",
        description="TGIS-compatible gRPC inference server. Every flag can also be set as the "
        "env var named in its help; a flag wins over its env var.",
    )
