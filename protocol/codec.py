"""msgpack codec with numpy arrays carried as extra zero-copy frames.

`encode(obj)` returns `[main, buf1, buf2, ...]`; an array inside `obj` becomes a msgpack Ext
that names its frame index, dtype and shape. `decode(frames)` rebuilds arrays on top of the
received buffers without copying. Only typed decoders exist: no pickle anywhere.
"""
from __future__ import annotations

import sys
from typing import Any, Generic, Sequence, TypeVar

import msgspec
import numpy as np

_ARRAY_EXT = 1
T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


class MsgpackEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[Buffer] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        self._aux = bufs = [b""]
        try:
            bufs[0] = self._encoder.encode(obj)
        finally:
            self._aux = None
        return bufs

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            assert self._aux is not None
            if obj.dtype.hasobject:
                raise TypeError("object arrays cannot be encoded")
            arr = np.ascontiguousarray(obj)
            self._aux.append(arr.data)
            meta = (len(self._aux) - 1, arr.dtype.str, list(arr.shape))
            return msgspec.msgpack.Ext(_ARRAY_EXT, msgspec.msgpack.encode(meta))
        raise TypeError(f"cannot encode objects of type {type(obj).__name__}")


class MsgpackDecoder(Generic[T]):
    def __init__(self, type_: type[T]) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._frames: Sequence[Buffer] = ()

    def decode(self, frames: Sequence[Buffer]) -> T:
        """Raises msgspec.DecodeError / ValidationError (or ValueError) on malformed input.

        Nesting is capped: msgspec counts each level against the interpreter's recursion
        limit, also when it skips a value, and a deeper message is a DecodeError here."""
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        except RecursionError:
            raise msgspec.DecodeError(
                f"message nested deeper than the recursion limit ({sys.getrecursionlimit()})") from None
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _ARRAY_EXT:
            raise ValueError(f"unknown msgpack extension type {code}")
        index, dtype, shape = msgspec.msgpack.decode(data, type=tuple[int, str, list[int]])
        if not 0 < index < len(self._frames):
            raise ValueError(f"array frame {index} missing from the message")
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError("object arrays are not accepted")
        return np.frombuffer(self._frames[index], dtype=dt).reshape(shape)

    @staticmethod
    def _dec_hook(type_: type, obj: Any) -> Any:
        if type_ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"cannot decode {type_}")
