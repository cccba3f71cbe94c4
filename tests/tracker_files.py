"""Readers of the experiment trackers' own files under RUN/logs (W&B's transaction log, SwanLab's record
log), for tests/test_trackers.py and tests/test_multiprocess.py."""

from __future__ import annotations

import glob
import json
from pathlib import Path


def wandb_history(run_dir: Path) -> tuple[list[str], list[dict]]:
    """(run ids, history rows) of every W&B offline session under RUN/logs/wandb, oldest first."""
    from swanlab.converter.wb.wbdatastore import WBDataStoreReader  # a reader of W&B's transaction log
    from wandb.proto import wandb_internal_pb2

    ids, rows = [], []
    for path in sorted(glob.glob(str(run_dir / "logs" / "wandb" / "offline-run-*" / "run-*.wandb"))):
        reader = WBDataStoreReader()
        reader.open(path)
        while (data := reader.scan()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return ids, rows


def swanlab_scalars(run_dir: Path) -> tuple[list[str], dict[tuple[str, int], float], set[str]]:
    """(run folders' ids, {(key, step): value} of every scalar, media keys) of the SwanLab sessions (local and offline
    modes write the same record log; local mode's dashboard, `swanlab watch RUN/logs/swanlab`, reads it)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    ids, scalars, media = [], {}, set()
    for path in sorted(glob.glob(str(run_dir / "logs" / "swanlab" / "run-*" / "run-*.swanlab"))):
        ids.append(Path(path).stem.removeprefix("run-"))
        reader = DataStoreReader()
        reader.open(path)
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            if record.HasField("scalar"):
                scalars[(record.scalar.key, record.scalar.step)] = record.scalar.value.number
            elif record.HasField("media"):
                media.add(record.media.key)
    return ids, scalars, media
