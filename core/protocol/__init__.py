"""The wire protocol: frames, cipher states, AAD, key schedule and errors.

The only part of the engine that holder agents import: standard library and ``cryptography`` only.
"""

from gputravel.core.protocol.cipher import (
    TAG_LEN,
    Aad,
    Direction,
    RecvState,
    ReplayWindow,
    SendState,
    nonce,
)
from gputravel.core.protocol.errors import (
    FrameError,
    GpuTravelError,
    NonceExhaustedError,
    ProtocolError,
    ReplayError,
    StaleEpochError,
    TagError,
    WindowError,
)
from gputravel.core.protocol.frames import (
    MAX_FRAME,
    MAX_PAYLOAD,
    Frame,
    FrameDecoder,
    FrameType,
    decode_frame,
    encode_frame,
    read_frame,
    write_frame,
)
from gputravel.core.protocol.keys import DirectionKey, channel_key, fingerprint, provisioning_key

__all__ = [
    "TAG_LEN", "Aad", "Direction", "RecvState", "ReplayWindow", "SendState", "nonce",
    "FrameError", "GpuTravelError", "NonceExhaustedError", "ProtocolError", "ReplayError",
    "StaleEpochError", "TagError", "WindowError",
    "MAX_FRAME", "MAX_PAYLOAD", "Frame", "FrameDecoder", "FrameType", "decode_frame", "encode_frame",
    "read_frame", "write_frame",
    "DirectionKey", "channel_key", "fingerprint", "provisioning_key",
]
