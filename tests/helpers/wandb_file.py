"""Read an offline W&B run file (run-*.wandb) back, record by record.

Format (wandb's LevelDB-style log): a 7-byte header (b':W&B', then version bytes), then
32 KiB blocks of records; each record has a 7-byte header (CRC32 u32, length u16, type
u8: 1 full, 2 first, 3 middle, 4 last) and a payload that parses as
wandb.proto.wandb_internal_pb2.Record. Records never straddle a block boundary; a tail
shorter than a header is padding.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue  # zero padding
        if kind == 1:
            pending = b""
            yield _parse(pb, payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield _parse(pb, pending + payload)
            pending = b""


def _parse(pb, payload: bytes):
    rec = pb.Record()
    rec.ParseFromString(payload)
    return rec


def history(path: Path) -> list[dict]:
    """The logged rows: {key: value} per wandb.log call, with `_step`."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def run_info(path: Path) -> dict:
    """The run record: id, project, and the config it was started with."""
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            config = {}
            for item in rec.run.config.update:
                key = item.key or "/".join(item.nested_key)
                config[key] = json.loads(item.value_json)
            return {"id": rec.run.run_id, "project": rec.run.project, "config": config}
    raise AssertionError(f"{path} holds no run record")


def summary(path: Path) -> dict:
    """The run's summary as its last summary records leave it: {key: value}."""
    out = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def config(path: Path) -> dict:
    """The run's config as its run record and later config updates leave it: {group: {...}}."""
    out: dict = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        items = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else ()
        for item in items:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def stats(path: Path) -> list[dict]:
    """The system monitor's samples: {metric: value} per sample (W&B's system charts)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "stats":
            rows.append({item.key: json.loads(item.value_json) for item in rec.stats.item})
    return rows
