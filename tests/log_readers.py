"""Read back what Lightning's loggers wrote: an offline W&B run and TensorBoard event files, without their apps."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def read_wandb_run(run_dir: Path) -> dict[str, Any]:
    """Read an offline run's ``.wandb`` file: LevelDB log format (32 KiB blocks of records with a 7-byte header:
    crc32, length, type) after a 7-byte file header, each record a ``wandb_internal_pb2.Record`` protobuf. wandb 0.31
    ships no Python reader (its service is in Go), so the test reads the format itself."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, pending = 32768, 7, b""
    history, config, alerts = [], {}, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # a block's tail too short for a header is padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):  # FULL or LAST completes a record
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        which = record.WhichOneof("record_type")
        if which == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
        elif which == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif which == "alert":
            alerts.append(record.alert.title)
    return {"history": history, "config": config, "alerts": alerts}


def read_tensorboard_scalars(directory: Path) -> list[tuple[str, int, float]]:
    """Every scalar of the event files under ``directory`` as (tag, step, value), in file order. The files are
    TFRecords (length, its CRC, an ``Event`` protobuf, its CRC); tensorboardX ships the protobuf but no reader."""
    from tensorboardX.proto import event_pb2

    scalars = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.append((value.tag, int(event.step), float(value.simple_value)))
    return scalars
