"""Interactive sample client for fmaas.GenerationService, in the flow of TGIS's sample_client.py.

For each prompt read from stdin: wrap it in an Alpaca-style template, stream exactly 100 greedy
tokens (min_new_tokens = max_new_tokens = 100) with GenerateStream from localhost:8033, then print
the output, ``Total_time`` and ``Time_per_token``. Ends cleanly at end of input (Ctrl-D) or on
Ctrl-C. Needs ``make gen-client`` first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import grpc
from google.protobuf import json_format
from text_generation_tests.pb import generation_pb2 as pb2
from text_generation_tests.pb import generation_pb2_grpc as gpb2

SERVER = "localhost:8033"
MAX_NEW_TOKENS = 100
TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{}\n\n### Response:"
)


def stream_text(stub: gpb2.GenerationServiceStub, prompt: str) -> Iterator[str]:
    """Yield the text delta of each generated-token message of one stream.

    The first message (the one carrying ``inputTokenCount``) holds no generated text and is
    skipped, as in TGIS's client.
    """
    request = json_format.ParseDict(
        {
            "model_id": "dummy-model-name",
            "request": {"text": TEMPLATE.format(prompt)},
            "params": {
                "method": "GREEDY",
                "stopping": {"max_new_tokens": MAX_NEW_TOKENS, "min_new_tokens": MAX_NEW_TOKENS},
            },
        },
        pb2.SingleGenerationRequest(),
    )
    for message in stub.GenerateStream(request):
        data = json_format.MessageToDict(message)
        if "inputTokenCount" not in data:
            yield data.get("text", "")


def main() -> int:
    """Prompt loop; returns the process exit code."""
    channel = grpc.insecure_channel(SERVER)
    stub = gpb2.GenerationServiceStub(channel)
    n = 0
    try:
        while True:
            n += 1
            try:
                prompt = input(f"\n{n}) Enter a prompt:\n")
            except EOFError:
                return 0
            print("-" * 40)
            print("Output:")
            output: list[str] = []
            start = time.perf_counter()
            try:
                output.extend(stream_text(stub, prompt))
            except grpc.RpcError as err:
                print(f"request failed: {err.code().name}: {err.details()}", file=sys.stderr)
                continue
            total_ms = (time.perf_counter() - start) * 1000.0
            print("".join(output))
            print("-" * 40)
            print(f"Total_time : {total_ms:.2f}ms")
            print(f"Time_per_token : {total_ms / MAX_NEW_TOKENS:.2f}ms")
    except KeyboardInterrupt:
        return 0
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
