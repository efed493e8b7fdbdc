"""specserve's TGIS-compatible gRPC front end (`fmaas.GenerationService`).

Protocol buffers live in `server.pb` (generated from `proto/generation.proto`, see
`server.proto_gen`); request validation in `server.validation`. No `*_pb2` type crosses into
`engine/`: the server converts to plain dataclasses first.
"""
