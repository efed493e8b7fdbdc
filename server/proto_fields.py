"""Fields of a request that this server's proto does not define: protobuf keeps them when it
parses a request from a newer client, and `check_known_fields` refuses such a request, naming the
field, rather than silently ignoring what the client asked for."""

from __future__ import annotations

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from server import messages as msg

KNOWN_EXTENSION_FIELDS = {
    "fmaas.BatchedGenerationRequest": {4: "adapter_id"},
    "fmaas.SingleGenerationRequest": {4: "adapter_id"},
    "fmaas.BatchedTokenizeRequest": {6: "prefix_id", 7: "adapter_id"},
    "fmaas.DecodingParameters": {
        3: "format",
        4: "json_schema",
        5: "regex",
        6: "choice",
        7: "grammar",
    },
}
"""Names of the fields vllm-tgis-adapter's generation.proto adds to TGIS's
(docs/tgis-compatibility.md, "Fields of newer clients"), by message and field number: LoRA
adapters and the `guided` oneof of guided decoding."""


def check_known_fields(message: Message, path: str = "") -> None:
    """Raise `messages.unknown_field_error` for the first field of `message`, or of a message
    inside it, that this server's proto does not define. protobuf keeps such fields when it
    parses a request from a newer client (vllm-tgis-adapter's adapter_id, guided decoding);
    serving the request without them would silently ignore what the client asked for."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        number = unknown[0].field_number
        name = message.DESCRIPTOR.full_name
        known = KNOWN_EXTENSION_FIELDS.get(name, {}).get(number)
        raise msg.unknown_field_error(name, number, path, known)
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        where = f"{path}.{field.name}" if path else field.name
        if isinstance(value, Message):
            check_known_fields(value, where)
        else:  # repeated
            for i, item in enumerate(value):
                check_known_fields(item, f"{where}[{i}]")
