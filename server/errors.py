"""Errors the server maps to gRPC status codes beyond validation (see `grpc_server`)."""


class GenerationError(Exception):
    """The engine failed a request (UNKNOWN, ``Request failed during generation: ...``)."""
