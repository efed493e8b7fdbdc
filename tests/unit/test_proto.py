"""proto/generation.proto against TGIS's public API (docs/tgis-compatibility.md, "The API": the
oracle).

The tables below are transcribed from the reference, not from the proto. Wire compatibility with
stubs generated from TGIS's own proto needs exactly these names, numbers, types and labels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, json_format
from grpc_tools import protoc

from server import proto_gen
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc as pb_grpc

FDP = descriptor_pb2.FieldDescriptorProto
STRING, BOOL, FLOAT = FDP.TYPE_STRING, FDP.TYPE_BOOL, FDP.TYPE_FLOAT
UINT32, UINT64 = FDP.TYPE_UINT32, FDP.TYPE_UINT64
MSG, ENUM = FDP.TYPE_MESSAGE, FDP.TYPE_ENUM
ONE, REP = FDP.LABEL_OPTIONAL, FDP.LABEL_REPEATED
OPT = "proto3 optional"  # explicit presence: `optional` in the proto

# message -> [(field, number, type, label, type name or None, *flags)]
MESSAGES: dict[str, list[tuple]] = {
    "fmaas.BatchedGenerationRequest": [
        ("model_id", 1, STRING, ONE, None),
        ("prefix_id", 2, STRING, ONE, None, OPT),
        ("requests", 3, MSG, REP, ".fmaas.GenerationRequest"),
        ("params", 10, MSG, ONE, ".fmaas.Parameters"),
    ],
    "fmaas.SingleGenerationRequest": [
        ("model_id", 1, STRING, ONE, None),
        ("prefix_id", 2, STRING, ONE, None, OPT),
        ("request", 3, MSG, ONE, ".fmaas.GenerationRequest"),
        ("params", 10, MSG, ONE, ".fmaas.Parameters"),
    ],
    "fmaas.BatchedGenerationResponse": [
        ("responses", 1, MSG, REP, ".fmaas.GenerationResponse"),
    ],
    "fmaas.GenerationRequest": [("text", 2, STRING, ONE, None)],
    "fmaas.GenerationResponse": [
        ("input_token_count", 6, UINT32, ONE, None),
        ("generated_token_count", 2, UINT32, ONE, None),
        ("text", 4, STRING, ONE, None),
        ("stop_reason", 7, ENUM, ONE, ".fmaas.StopReason"),
        ("stop_sequence", 11, STRING, ONE, None),
        ("seed", 10, UINT64, ONE, None),
        ("tokens", 8, MSG, REP, ".fmaas.TokenInfo"),
        ("input_tokens", 9, MSG, REP, ".fmaas.TokenInfo"),
    ],
    "fmaas.Parameters": [
        ("method", 1, ENUM, ONE, ".fmaas.DecodingMethod"),
        ("sampling", 2, MSG, ONE, ".fmaas.SamplingParameters"),
        ("stopping", 3, MSG, ONE, ".fmaas.StoppingCriteria"),
        ("response", 4, MSG, ONE, ".fmaas.ResponseOptions"),
        ("decoding", 5, MSG, ONE, ".fmaas.DecodingParameters"),
        ("truncate_input_tokens", 6, UINT32, ONE, None),
    ],
    "fmaas.SamplingParameters": [
        ("temperature", 1, FLOAT, ONE, None),
        ("top_k", 2, UINT32, ONE, None),
        ("top_p", 3, FLOAT, ONE, None),
        ("typical_p", 4, FLOAT, ONE, None),
        ("seed", 5, UINT64, ONE, None, OPT),
    ],
    "fmaas.StoppingCriteria": [
        ("max_new_tokens", 1, UINT32, ONE, None),
        ("min_new_tokens", 2, UINT32, ONE, None),
        ("time_limit_millis", 3, UINT32, ONE, None),
        ("stop_sequences", 4, STRING, REP, None),
        ("include_stop_sequence", 5, BOOL, ONE, None, OPT),
    ],
    "fmaas.ResponseOptions": [
        ("input_text", 1, BOOL, ONE, None),
        ("generated_tokens", 2, BOOL, ONE, None),
        ("input_tokens", 3, BOOL, ONE, None),
        ("token_logprobs", 4, BOOL, ONE, None),
        ("token_ranks", 5, BOOL, ONE, None),
        ("top_n_tokens", 6, UINT32, ONE, None),
    ],
    "fmaas.DecodingParameters": [
        ("repetition_penalty", 1, FLOAT, ONE, None),
        ("length_penalty", 2, MSG, ONE, ".fmaas.DecodingParameters.LengthPenalty", OPT),
    ],
    "fmaas.DecodingParameters.LengthPenalty": [
        ("start_index", 1, UINT32, ONE, None),
        ("decay_factor", 2, FLOAT, ONE, None),
    ],
    "fmaas.TokenInfo": [
        ("text", 2, STRING, ONE, None),
        ("logprob", 3, FLOAT, ONE, None),
        ("rank", 4, UINT32, ONE, None),
        ("top_tokens", 5, MSG, REP, ".fmaas.TokenInfo.TopToken"),
    ],
    "fmaas.TokenInfo.TopToken": [
        ("text", 2, STRING, ONE, None),
        ("logprob", 3, FLOAT, ONE, None),
    ],
    "fmaas.BatchedTokenizeRequest": [
        ("model_id", 1, STRING, ONE, None),
        ("requests", 2, MSG, REP, ".fmaas.TokenizeRequest"),
        ("return_tokens", 3, BOOL, ONE, None),
        ("return_offsets", 4, BOOL, ONE, None),
        ("truncate_input_tokens", 5, UINT32, ONE, None),
    ],
    "fmaas.BatchedTokenizeResponse": [
        ("responses", 1, MSG, REP, ".fmaas.TokenizeResponse"),
    ],
    "fmaas.TokenizeRequest": [("text", 1, STRING, ONE, None)],
    "fmaas.TokenizeResponse": [
        ("token_count", 1, UINT32, ONE, None),
        ("tokens", 2, STRING, REP, None),
        ("offsets", 3, MSG, REP, ".fmaas.TokenizeResponse.Offset"),
    ],
    "fmaas.TokenizeResponse.Offset": [
        ("start", 1, UINT32, ONE, None),
        ("end", 2, UINT32, ONE, None),
    ],
    "fmaas.ModelInfoRequest": [("model_id", 1, STRING, ONE, None)],
    "fmaas.ModelInfoResponse": [
        ("model_kind", 1, ENUM, ONE, ".fmaas.ModelInfoResponse.ModelKind"),
        ("max_sequence_length", 2, UINT32, ONE, None),
        ("max_new_tokens", 3, UINT32, ONE, None),
    ],
}

ENUMS: dict[str, dict[str, int]] = {
    "fmaas.DecodingMethod": {"GREEDY": 0, "SAMPLE": 1},
    "fmaas.StopReason": {
        "NOT_FINISHED": 0,
        "MAX_TOKENS": 1,
        "EOS_TOKEN": 2,
        "CANCELLED": 3,
        "TIME_LIMIT": 4,
        "STOP_SEQUENCE": 5,
        "TOKEN_LIMIT": 6,
        "ERROR": 7,
    },
    "fmaas.ModelInfoResponse.ModelKind": {"DECODER_ONLY": 0, "ENCODER_DECODER": 1},
}

# method -> (input, output, client streaming, server streaming)
METHODS = {
    "Generate": (
        ".fmaas.BatchedGenerationRequest",
        ".fmaas.BatchedGenerationResponse",
        False,
        False,
    ),
    "GenerateStream": (".fmaas.SingleGenerationRequest", ".fmaas.GenerationResponse", False, True),
    "Tokenize": (".fmaas.BatchedTokenizeRequest", ".fmaas.BatchedTokenizeResponse", False, False),
    "ModelInfo": (".fmaas.ModelInfoRequest", ".fmaas.ModelInfoResponse", False, False),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorProto:
    """proto/generation.proto compiled afresh by protoc (independent of server/pb)."""
    out = tmp_path_factory.mktemp("proto") / "generation.pb"
    proto = proto_gen.PROTO_FILE
    rc = protoc.main(
        ["protoc", f"--proto_path={proto.parent}", f"--descriptor_set_out={out}", str(proto)]
    )
    assert rc == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert len(files) == 1
    return files[0]


def _walk(
    prefix: str, messages: list[descriptor_pb2.DescriptorProto]
) -> tuple[
    dict[str, descriptor_pb2.DescriptorProto], dict[str, descriptor_pb2.EnumDescriptorProto]
]:
    msgs, enums = {}, {}
    for m in messages:
        name = f"{prefix}.{m.name}"
        msgs[name] = m
        enums.update({f"{name}.{e.name}": e for e in m.enum_type})
        sub_msgs, sub_enums = _walk(name, list(m.nested_type))
        msgs.update(sub_msgs)
        enums.update(sub_enums)
    return msgs, enums


def test_file_header(compiled: descriptor_pb2.FileDescriptorProto) -> None:
    assert compiled.syntax == "proto3"
    assert compiled.package == "fmaas"
    assert not compiled.HasField("options")
    assert list(compiled.dependency) == []


def test_messages_and_fields(compiled: descriptor_pb2.FileDescriptorProto) -> None:
    msgs, _ = _walk("fmaas", list(compiled.message_type))
    assert set(msgs) == set(MESSAGES)
    for msg_name, expected in MESSAGES.items():
        actual = sorted(
            (
                f.name,
                f.number,
                f.type,
                f.label,
                f.type_name or None,
                *((OPT,) if f.proto3_optional else ()),
            )
            for f in msgs[msg_name].field
        )
        assert actual == sorted(expected), msg_name


def test_enums(compiled: descriptor_pb2.FileDescriptorProto) -> None:
    _, nested = _walk("fmaas", list(compiled.message_type))
    enums = {f"fmaas.{e.name}": e for e in compiled.enum_type} | nested
    assert set(enums) == set(ENUMS)
    for name, values in ENUMS.items():
        assert {v.name: v.number for v in enums[name].value} == values, name


def test_service(compiled: descriptor_pb2.FileDescriptorProto) -> None:
    assert [s.name for s in compiled.service] == ["GenerationService"]
    methods = {
        m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
        for m in compiled.service[0].method
    }
    assert methods == METHODS


def test_generated_stubs_match_proto(compiled: descriptor_pb2.FileDescriptorProto) -> None:
    """server/pb is up to date: same descriptor as the proto, only the file name differs."""
    generated = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(generated)
    assert generated.name == f"{proto_gen.PACKAGE_DIR}/generation.proto"
    expected = descriptor_pb2.FileDescriptorProto()
    expected.CopyFrom(compiled)
    expected.name = generated.name
    msgs, _ = _walk("fmaas", list(expected.message_type))
    for m in msgs.values():
        for f in m.field:
            f.ClearField("json_name")  # protoc's descriptor sets add it; generated code omits it
    assert generated == expected
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "fmaas.GenerationService"
    assert hasattr(pb_grpc, "GenerationServiceStub")
    assert hasattr(pb_grpc, "add_GenerationServiceServicer_to_server")


def test_generated_imports_are_package_absolute() -> None:
    source = (proto_gen.PB_DIR / "generation_pb2_grpc.py").read_text()
    assert "from server.pb import generation_pb2 as" in source
    assert "\nimport generation_pb2" not in source
    assert pb_grpc.__name__ == "server.pb.generation_pb2_grpc"


def test_wire_bytes() -> None:
    """Hand-encoded bytes (tag = number << 3 | wire type) decode and encode as TGIS's would."""
    req = pb.SingleGenerationRequest(
        model_id="m",
        request=pb.GenerationRequest(text="hi"),
        params=pb.Parameters(
            stopping=pb.StoppingCriteria(max_new_tokens=100, min_new_tokens=100),
        ),
    )
    # model_id: 0a 01 "m"; request: 1a 04 {text: 12 02 "hi"}; params: 52 06 {stopping: 1a 04 {..}}
    wire = bytes.fromhex("0a 01 6d 1a 04 12 02 68 69 52 06 1a 04 08 64 10 64")
    assert req.SerializeToString() == wire
    assert pb.SingleGenerationRequest.FromString(wire) == req

    # input_token_count=6 (field 6), seed=99 (10), stop_sequence="x" (11), stop_reason=5 (7)
    resp = pb.GenerationResponse.FromString(bytes.fromhex("30 06 50 63 5a 01 78 38 05"))
    assert resp.input_token_count == 6
    assert resp.seed == 99
    assert resp.stop_sequence == "x"
    assert resp.stop_reason == pb.STOP_SEQUENCE


def test_json_mapping() -> None:
    """The MessageToDict conventions that sample_client and the YAML tests rely on."""
    resp = pb.GenerationResponse(generated_token_count=3, text="abc", seed=99)
    assert json_format.MessageToDict(resp) == {
        "generatedTokenCount": 3,
        "text": "abc",
        "seed": "99",
    }
    assert json_format.MessageToDict(pb.GenerationResponse()) == {}
    req = json_format.ParseDict(
        {"params": {"method": "SAMPLE", "sampling": {"seed": 7}}, "requests": [{"text": "a"}]},
        pb.BatchedGenerationRequest(),
    )
    assert req.params.method == pb.SAMPLE
    assert req.params.sampling.HasField("seed")


def test_regenerates_only_when_stale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        calls.append(argv)
        return 1  # generate() must raise before touching server/pb

    monkeypatch.setattr(protoc, "main", fake_main)
    proto_gen.generate()  # up to date (the import above generated or checked it)
    assert calls == []
    with pytest.raises(RuntimeError, match=r"grpc_tools\.protoc failed"):
        proto_gen.generate(force=True)
    assert len(calls) == 1
    assert f"--proto_path={proto_gen.PACKAGE_DIR}={proto_gen.PROTO_FILE.parent}" in calls[0]
    assert not list(proto_gen.PB_DIR.glob(".gen-*"))  # temp dir cleaned up
