"""TensorBoard scalars written directly: an `events.out.tfevents.*` file of TFRecords, each an `Event` protobuf.

torch.utils.tensorboard.SummaryWriter writes the same records, but importing it (TensorBoard, protobuf, and
boto3 where s3fs brought it) costs about 0.3 s of every run's start; these are the few bytes a scalar needs:

    record   = length (uint64 LE) | masked CRC-32C of length | data | masked CRC-32C of data
    Event    = 1: wall_time (double) | 2: step (int64) | 3: file_version (string) | 5: summary (Summary)
    Summary  = 1: value (Value, repeated);  Value = 1: tag (string) | 2: simple_value (float)

as TensorBoard's own readers (tensorboard/compat/proto/event.proto, summary.proto; the record format of
tensorboard/summary/writer/record_writer.py) define them; tests/e2e/test_ux.py reads the file with TensorBoard's
EventAccumulator.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF  # TFRecord's mask


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (a string or an embedded message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    summary_value = _field(1, tag.encode("utf-8")) + b"\x15" + struct.pack("<f", value)
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + _field(5, _field(1, summary_value))


def record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFile:
    """One events file in `log_dir`, named as SummaryWriter names them; every `add_scalars` is written and
    flushed at once (a run killed between two log rows loses nothing already logged)."""

    def __init__(self, log_dir: Path) -> None:
        now = time.time()
        self.path = log_dir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.0"
        self._file = self.path.open("ab")
        file_version = b"\x09" + struct.pack("<d", now) + _field(3, b"brain.Event:2")
        self._write([file_version])

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        now = time.time()
        self._write([scalar_event(tag, float(value), step, now) for tag, value in values.items()])

    def _write(self, events: list[bytes]) -> None:
        self._file.write(b"".join(record(event) for event in events))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
