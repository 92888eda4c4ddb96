"""A minimal GGUF v3 writer for tests: real files with F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors.

The encoders follow llama.cpp's reference quantizers (quantize_row_q8_0_ref,
quantize_row_q4_0_ref, quantize_row_q4_1_ref), so MLX reads these files exactly as it reads real ones.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q6_K": 14, "BF16": 30}
ALIGNMENT = 32


def encode_q8_0(x: np.ndarray) -> bytes:
    """Blocks of 32 along the last axis: fp16 scale d = amax/127, then 32 int8."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.round(blocks * inv).astype(np.int8)
    out = np.empty((len(blocks), 34), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out.tobytes()


def encode_q4_0(x: np.ndarray) -> bytes:
    """Blocks of 32: fp16 scale d = (signed absmax)/-8, 16 bytes of nibbles, x = (q-8)*d.

    Byte j holds element j in its low nibble and element j+16 in its high one.
    """
    blocks = x.astype(np.float32).reshape(-1, 32)
    idx = np.abs(blocks).argmax(axis=1)
    d = blocks[np.arange(len(blocks)), idx][:, None] / -8.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, (blocks * inv + 8.5).astype(np.int8)).astype(np.uint8)
    out = np.empty((len(blocks), 18), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out.tobytes()


def encode_q4_1(x: np.ndarray) -> bytes:
    """Blocks of 32: fp16 d = (max-min)/15 and m = min, 16 bytes of nibbles, x = q*d + m."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    lo, hi = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
    d = (hi - lo) / 15.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, ((blocks - lo) * inv + 0.5).astype(np.int8)).astype(np.uint8)
    out = np.empty((len(blocks), 20), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:4] = lo.astype(np.float16).view(np.uint8)
    out[:, 4:] = q[:, :16] | (q[:, 16:] << 4)
    return out.tobytes()


def decode_q4_1(x: np.ndarray) -> np.ndarray:
    raw = np.frombuffer(encode_q4_1(x), np.uint8).reshape(-1, 20)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([raw[:, 4:] & 15, raw[:, 4:] >> 4], axis=1).astype(np.float32)
    return (q * d + m).reshape(x.shape)


def decode_q4_0(x: np.ndarray) -> np.ndarray:
    """What a Q4_0 file holds for `x`, as floats (the quantization error, made explicit)."""
    raw = np.frombuffer(encode_q4_0(x), np.uint8).reshape(-1, 18)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([raw[:, 2:] & 15, raw[:, 2:] >> 4], axis=1).astype(np.float32)
    return ((q - 8) * d).reshape(x.shape)


def decode_q8_0(x: np.ndarray) -> np.ndarray:
    raw = np.frombuffer(encode_q8_0(x), np.uint8).reshape(-1, 34)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)
    return (raw[:, 2:].copy().view(np.int8).astype(np.float32) * d).reshape(x.shape)


def encode(x: np.ndarray, type_name: str) -> bytes:
    if type_name == "F32":
        return x.astype("<f4").tobytes()
    if type_name == "F16":
        return x.astype("<f2").tobytes()
    if type_name == "BF16":
        return (x.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()  # truncation
    if type_name == "Q8_0":
        return encode_q8_0(x)
    if type_name == "Q4_0":
        return encode_q4_0(x)
    if type_name == "Q4_1":
        return encode_q4_1(x)
    if type_name == "Q6_K":  # only its size matters: 210 bytes per 256 values
        return bytes(x.size // 256 * 210)
    raise ValueError(type_name)


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v) -> tuple[int, bytes]:
    """(GGUF value type, payload); ints are UINT32 (INT32 inside arrays), floats FLOAT32."""
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return (4, struct.pack("<I", v)) if v >= 0 else (5, struct.pack("<i", v))
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, _string(v)
    if isinstance(v, list):
        if all(isinstance(e, str) for e in v):
            return 9, struct.pack("<IQ", 8, len(v)) + b"".join(_string(e) for e in v)
        if all(isinstance(e, int) for e in v):
            return 9, struct.pack("<IQ", 5, len(v)) + struct.pack(f"<{len(v)}i", *v)
        return 9, struct.pack("<IQ", 6, len(v)) + struct.pack(f"<{len(v)}f", *v)
    raise TypeError(type(v))


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    """Write `tensors` (name -> (type name, array in numpy order)) with `metadata`."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, v in metadata.items():
        vtype, payload = _value(v)
        head += _string(key) + struct.pack("<I", vtype) + payload
    data, offsets = b"", []
    for name, (type_name, array) in tensors.items():
        data += bytes(-len(data) % ALIGNMENT)
        offsets.append(len(data))
        data += encode(array, type_name)
    for (name, (type_name, array)), offset in zip(tensors.items(), offsets):
        dims = array.shape[::-1]  # GGUF lists the innermost dimension first
        head += _string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        head += struct.pack("<IQ", TYPE_IDS[type_name], offset)
    head += bytes(-len(head) % ALIGNMENT)
    Path(path).write_bytes(head + data)
    return Path(path)


def byte_level_tokens() -> list[str]:
    """GPT-2's byte -> printable character table: the base vocabulary of byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]
