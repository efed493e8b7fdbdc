"""The OpenAI-compatible HTTP API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) on
the engine the gRPC API uses; docs/deployment.md lists its fields and its differences from
OpenAI's."""
