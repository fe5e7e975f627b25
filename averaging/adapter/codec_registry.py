"""Our codecs on hivemind's wire: hivemind decodes a message by the name of its compression type, an enum of its
own six; our codecs (averaging/codecs/lowbit.py and sparse.py) send ids above those, registered here under names of
their own."""
from __future__ import annotations

from hivemind.proto import runtime_pb2

from averaging.codecs import lowbit, sparse

_CODEC_NAMES = {codec_id: f"SWARMTRAIN_{name.upper()}" for name, codec_id in lowbit.CODEC_IDS.items()}
# each decodes any message of its id (its settings are in the message's header)
_DECODERS = {"int8": lowbit.BlockwiseAbsmax(8), "int4": lowbit.BlockwiseAbsmax(4), "topk": sparse.TopK()}


def register_codecs() -> None:
    """deserialize_torch_tensor looks a decoder up by CompressionType.Name(id): teach Name our ids, and the
    table our decoders (each reads its settings from the message's header, so one instance decodes all)."""
    from hivemind.compression import serialization

    for name, codec_id in lowbit.CODEC_IDS.items():
        serialization._BASE_COMPRESSION_TYPES[_CODEC_NAMES[codec_id]] = _DECODERS[name]
    enum = runtime_pb2.CompressionType
    if getattr(enum.Name, "knows_swarmtrain_codecs", False):
        return
    upstream_name = enum.Name

    def name_of(number: int) -> str:
        return _CODEC_NAMES.get(number) or upstream_name(number)

    name_of.knows_swarmtrain_codecs = True
    enum.Name = name_of
