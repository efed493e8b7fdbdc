"""TGIS's validation messages, verbatim (its router's validation.rs), and the error they
travel in: `ValidationError`, answered as INVALID_ARGUMENT. `clip` bounds user text quoted in
any error message."""

from __future__ import annotations

MAX_STOP_SEQS = 6
MAX_STOP_SEQ_BYTES = 240
MAX_TOP_N_TOKENS = 10
"""vllm-tgis-adapter's bound on top_n_tokens (TGIS's proto comment says 5; TGIS enforces none)."""
MAX_QUOTED_BYTES = 256
"""User text quoted in an error message is cut to this many UTF-8 bytes (see `clip`)."""

# Fixed messages, verbatim from TGIS's router (validation.rs); see also the builders below.
TEMPERATURE_MSG = "temperature must be >= 0.05"
TOP_P_MSG = "top_p must be > 0.0 and <= 1.0"
TYPICAL_P_MSG = "typical_p must be <= 1.0"
TOP_K_MSG = "top_k must be strictly positive"
MIN_NEW_TOKENS_MSG = "min_new_tokens must be <= max_new_tokens"
REPETITION_PENALTY_MSG = "repetition_penalty must be > 0.0"
LENGTH_PENALTY_MSG = "length_penalty must be >= 1.0 and <= 10.0"
STOP_SEQUENCES_MSG = (
    f"can specify at most {MAX_STOP_SEQS} non-empty stop sequences, "
    f"each not more than {MAX_STOP_SEQ_BYTES} UTF8 bytes"
)
TOKEN_DETAIL_MSG = "must request input and/or generated tokens to request extra token detail"
MISSING_REQUEST_MSG = "missing request"


class ValidationError(ValueError):
    """An invalid request; `message` is the exact TGIS text for the INVALID_ARGUMENT status."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def max_new_tokens_error(server_max: int) -> ValidationError:
    """``max_new_tokens must be <= {server_max}``."""
    return ValidationError(f"max_new_tokens must be <= {server_max}")


def input_length_error(input_tokens: int, prefix_length: int, max_len: int) -> ValidationError:
    """Input (after truncation) plus prefix leaves no room to generate."""
    return ValidationError(
        f"input tokens ({input_tokens}) plus prefix length ({prefix_length}) must be < {max_len}"
    )


def input_min_length_error(
    input_tokens: int, prefix_length: int, min_new_tokens: int, max_len: int
) -> ValidationError:
    """Input plus prefix plus min_new_tokens exceeds the sequence limit."""
    return ValidationError(
        f"input tokens ({input_tokens}) plus prefix length ({prefix_length}) "
        f"plus min_new_tokens ({min_new_tokens}) must be <= {max_len}"
    )


def clip(text: str, max_bytes: int = MAX_QUOTED_BYTES) -> str:
    """`text` for quoting in an error message: unchanged up to `max_bytes` UTF-8 bytes, else its
    first `max_bytes` bytes (never half a character) followed by an ellipsis. Error messages
    travel in gRPC metadata, whose size is limited (an oversized one reaches the client as
    RESOURCE_EXHAUSTED instead of the error)."""
    if len(text) <= max_bytes // 4:
        return text
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", "ignore") + "…"


def decoding_method_error(method: int) -> ValidationError:
    """A `method` number DecodingMethod does not define (proto3 keeps any number on the wire)."""
    return ValidationError(f"method ({method}) must be GREEDY (0) or SAMPLE (1)")


def top_n_tokens_error(top_n_tokens: int) -> ValidationError:
    """``top_n_tokens (N) must be <= 10`` (vllm-tgis-adapter)."""
    return ValidationError(f"top_n_tokens ({top_n_tokens}) must be <= {MAX_TOP_N_TOKENS}")


def prefix_not_found_reason(prefix_id: str) -> str:
    """The `reason` for an unknown prompt-prefix id, to pass to `prefix_lookup_error`."""
    return f'prefix id "{clip(prefix_id)}" not found'


def prefix_lookup_error(prefix_id: str, reason: str) -> ValidationError:
    """A prompt-prefix (prefix_id) that could not be loaded; `reason` is the loader's message."""
    return ValidationError(
        f"can't retrieve prompt prefix with id '{clip(prefix_id)}': {clip(reason, 1024)}"
    )


def prefix_token_details_error() -> ValidationError:
    """Input token details (logprobs, ranks, top tokens) asked for with a prompt prefix: the
    prefix's virtual tokens have none, and this server does not score the input after them."""
    return ValidationError(
        "input token logprobs, ranks and top_n_tokens are not supported with a prefix_id"
    )


def tokenizer_error(detail: str) -> ValidationError:
    """Tokenization of a generation input failed (Tokenize RPC errors are UNKNOWN instead)."""
    return ValidationError(f"tokenizer error {clip(detail)}")


def input_size_error(num_bytes: int, max_bytes: int) -> ValidationError:
    """An input text longer than `Limits.max_input_bytes`."""
    return ValidationError(
        f"input text is {num_bytes} UTF-8 bytes, more than the {max_bytes} allowed per input"
    )


def unknown_field_error(
    message_type: str, number: int, path: str, name: str | None
) -> ValidationError:
    """A request field this server's proto does not define (sent by a newer client, e.g.
    vllm-tgis-adapter's adapter_id or guided decoding): refused rather than ignored, since
    ignoring it would change the output silently. `path` locates the message holding it
    (empty: the request itself); `name` is the field's name in the proto that defines it, when
    known."""
    where = f" in {path}" if path else ""
    what = f"number {number} of {message_type}"
    if name:
        what = f"'{name}' ({what})"
    return ValidationError(
        f"unsupported request field {what}{where}: this server does not implement it"
    )
