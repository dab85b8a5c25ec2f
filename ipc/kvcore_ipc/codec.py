"""msgpack framing of the protocol: typed decoding, size limits, error replies.

One request or reply is one ZeroMQ frame holding one msgpack map
(kvcore_ipc.messages). Decoders and encoders are built once and reused: the
single-op path allocates no codec objects per request.

A frame that fails to decode becomes a :class:`FrameError` carrying the stable
error code the daemon answers with (``bad_request`` or ``unknown_op``) and the
request id when it could still be read (else 0).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from kvcore_ipc.messages import OP_NAMES, ErrorBody, Reply, Request, TypedReply

T = TypeVar("T")

DEFAULT_MAX_FRAME_BYTES = 8 << 20  # requests above this are refused (bad_request)
DEFAULT_MAX_BATCH = 4096  # operations per batch


class FrameError(Exception):
    """A frame that is not a valid request; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


class _IdOnly(msgspec.Struct):
    """Only the id of a request or reply (the other fields are skipped)."""

    id: int = 0


class _Probe(msgspec.Struct):
    """What can be salvaged from an undecodable request: its id and its op name."""

    id: int = 0
    body: Any = None


class ServerCodec:
    """Daemon side: bytes -> Request, result -> bytes."""

    __slots__ = ("_decoder", "_encoder", "_id", "_probe", "max_batch", "max_frame_bytes")

    def __init__(
        self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_batch: int = DEFAULT_MAX_BATCH
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.max_batch = max_batch
        self._decoder = msgspec.msgpack.Decoder(Request)
        self._probe = msgspec.msgpack.Decoder(_Probe)
        self._id = msgspec.msgpack.Decoder(_IdOnly)
        self._encoder = msgspec.msgpack.Encoder()

    def decode_request(self, frame: bytes) -> Request:
        """The typed request in ``frame``; FrameError if it is too large or malformed."""
        if len(frame) > self.max_frame_bytes:
            raise FrameError(
                "bad_request", f"frame of {len(frame)} bytes; at most {self.max_frame_bytes}"
            )
        try:
            request = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise self._explain(frame, exc) from None
        ops = getattr(request.body, "ops", None)
        if ops is not None and len(ops) > self.max_batch:
            raise FrameError(
                "bad_request", f"batch of {len(ops)} ops; at most {self.max_batch}", request.id
            )
        return request

    def _explain(self, frame: bytes, exc: Exception) -> FrameError:
        try:
            probe = self._probe.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            # RecursionError: a body nested deeper than the untyped probe can follow
            return FrameError("bad_request", f"undecodable request: {exc}")
        request_id = probe.id if isinstance(probe.id, int) and probe.id >= 0 else 0
        op = probe.body.get("op") if isinstance(probe.body, dict) else None
        if isinstance(op, str) and op not in OP_NAMES:
            return FrameError("unknown_op", f"unknown op {op[:64]!r}", request_id)
        return FrameError("bad_request", f"invalid request: {exc}", request_id)

    def encode_result(self, request_id: int, result: msgspec.Struct) -> bytes:
        return self._encoder.encode(Reply(request_id, result))

    def encode_error(self, request_id: int, code: str, message: str) -> bytes:
        return self._encoder.encode(Reply(request_id, error=ErrorBody(code, message)))

    def refusal(self, frame: bytes, code: str, message: str) -> bytes:
        """An error reply to ``frame`` without serving it: its id if it has one, else 0."""
        try:
            request_id = max(0, self._id.decode(frame).id)
        except (msgspec.DecodeError, msgspec.ValidationError):
            request_id = 0
        return self.encode_error(request_id, code, message)


class ClientCodec:
    """Client side: Request -> bytes, bytes -> TypedReply[result type] in one decode."""

    __slots__ = ("_decoders", "_encoder", "_replies", "_reply_id")

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
        self._replies: dict[Any, msgspec.msgpack.Decoder[Any]] = {}  # by result type
        self._reply_id = msgspec.msgpack.Decoder(_IdOnly)

    def encode(self, request: Request) -> bytes:
        return self._encoder.encode(request)

    def _decoder(self, typ: Any) -> msgspec.msgpack.Decoder[Any]:
        decoder = self._decoders.get(typ)
        if decoder is None:
            decoder = self._decoders[typ] = msgspec.msgpack.Decoder(typ)
        return decoder

    def decode_reply(self, frame: bytes, result_type: type[T]) -> TypedReply[T]:
        """The reply in ``frame``, its result decoded as ``result_type``."""
        decoder = self._replies.get(result_type)
        if decoder is None:
            reply_type = TypedReply[result_type]  # type: ignore[valid-type]
            decoder = self._replies[result_type] = msgspec.msgpack.Decoder(reply_type)
        reply: TypedReply[T] = decoder.decode(frame)
        return reply

    def reply_id(self, frame: bytes) -> int | None:
        """The id of a reply whose result did not decode as expected; None if unreadable."""
        try:
            return self._reply_id.decode(frame).id
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def decode_result(self, raw: msgspec.Raw | bytes, result_type: type[T]) -> T:
        """A result left raw (e.g. inside RawBatchOk) decoded as ``result_type``."""
        result: T = self._decoder(result_type).decode(raw)
        return result
