"""A model-shaped tree shared by the object-store tests: nested folders, a zero-byte file and a
file spanning several chunks, plus the checksums each backend should report."""

from __future__ import annotations

import base64
import hashlib
import os
import zlib

from modelcache.sources.base import RemoteFile, Source
from modelcache.sources.credentials import Settings


def model_tree() -> dict[str, bytes]:
    rnd = os.urandom
    return {
        "config.json": b'{"model_type": "test"}\n',
        "empty.txt": b"",
        "weights/model-00001.safetensors": rnd(3 << 20),  # 3 MiB: several 1 MiB chunks
        "weights/deep/nested/tokenizer.json": rnd(4096),
    }


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def crc32_hex(data: bytes) -> str:
    return zlib.crc32(data).to_bytes(4, "big").hex()


def crc32c_hex(data: bytes) -> str:
    import google_crc32c

    return google_crc32c.value(data).to_bytes(4, "big").hex()


def b64(hexval: str) -> str:
    return base64.b64encode(bytes.fromhex(hexval)).decode()


def read_range(source: Source, f: RemoteFile, start: int = 0, end: int | None = None, bufsize: int = 70000) -> bytes:
    stream = source.open_range(f, start, end)
    out = bytearray()
    buf = bytearray(bufsize)
    try:
        while n := stream.readinto(memoryview(buf)):
            out += buf[:n]
    finally:
        stream.close()
    return bytes(out)


def settings(env: dict[str, str]) -> Settings:
    return Settings.from_env(env)
