"""Metrics to JSONL (always) and TensorBoard event files (written without TensorFlow).

A tfevents file is a sequence of TFRecords: ``uint64 length, uint32 masked_crc32c(length),
bytes data, uint32 masked_crc32c(data)``, each ``data`` an ``Event`` protocol buffer
(``wall_time`` = 1: double, ``step`` = 2: int64, ``file_version`` = 3: string,
``summary`` = 5: ``Summary{ repeated Value value = 1 { tag = 1: string,
simple_value = 2: float } }``). The few protobuf fields are encoded by hand here.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

import numpy as np

_CRC32C_POLY = 0x82F63B78
_CRC_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _CRC32C_POLY if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecords use."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def event_proto(wall_time: float, step: int, *, scalars: dict[str, float] | None = None,
                file_version: str | None = None) -> bytes:
    """An ``Event`` message with a file version or a summary of scalar values."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5)
                         + struct.pack("<f", float(value)))
            for tag, value in scalars.items())
        out += _bytes_field(5, values)
    return out


def tfrecord(data: bytes) -> bytes:
    """One TFRecord framing ``data``."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


class MetricWriter:
    """Appends ``{"step", name: value, ...}`` lines to ``metrics.jsonl`` and scalar summaries
    to ``events.out.tfevents.*`` under ``workdir`` (``tensorboard=False`` skips the latter).

    ``enabled=False`` makes every call a no-op and creates no file: on a pod every host computes
    the same global metrics, and only process 0 should write them to the shared workdir
    (the trainer passes ``enabled=jax.process_index() == 0``).
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = self._events = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a")
        self._events = None
        if tensorboard:
            name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
            self.events_path = os.path.join(workdir, name)
            self._events = open(self.events_path, "ab")
            self._events.write(tfrecord(event_proto(time.time(), 0,
                                                    file_version="brain.Event:2")))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Writes one row; values become Python floats (numpy / JAX scalars accepted)."""
        if not self.enabled:
            return
        values = {k: float(np.asarray(v)) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), **values}) + "\n")
        self._jsonl.flush()
        if self._events is not None:
            self._events.write(tfrecord(event_proto(time.time(), int(step), scalars=values)))
            self._events.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._events is not None:
            self._events.close()


def read_jsonl(path: str) -> list[dict]:
    """The rows of a metrics.jsonl file."""
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
