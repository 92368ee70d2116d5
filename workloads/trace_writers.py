"""Writing trace records back in their file formats (the inverse of trace_formats).

Useful to cut a shipped trace down (window, sample) into a small file, and to check the
parsers by round trip. A path ending in ``.gz`` is gzip-compressed. ShareGPT is not
written: its records keep token ids, not the conversation text.
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from kvbench.workloads.trace_formats import TraceRecord
from kvbench.workloads.trace_io import AZURE_HEADER, BURSTGPT_HEADER


def _open_write(path: str | Path) -> TextIO:
    if str(path).endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "wb"), encoding="utf-8", newline="")
    return open(path, "w", encoding="utf-8", newline="")


def write_mooncake(records: Iterable[TraceRecord], path: str | Path) -> None:
    """Write Mooncake JSONL (timestamps back to integer ms). Records need ``hash_ids``;
    raises ValueError naming the record's line otherwise."""
    with _open_write(path) as handle:
        for record in records:
            if record.hash_ids is None:
                raise ValueError(f"line {record.line}: record has no hash_ids; Mooncake needs them")
            row = {
                "timestamp": round(record.timestamp_s * 1000),
                "input_length": record.input_length,
                "output_length": record.output_length,
                "hash_ids": list(record.hash_ids),
            }
            handle.write(json.dumps(row) + "\n")


def write_azure(records: Iterable[TraceRecord], path: str | Path, time_origin: str = "2023-11-16") -> None:
    """Write an Azure CSV; ``timestamp_s`` counts from midnight of ``time_origin`` and is
    written with 7 fractional digits (100 ns ticks), as upstream."""
    midnight = dt.datetime.combine(dt.date.fromisoformat(time_origin), dt.time())
    with _open_write(path) as handle:
        writer = csv.writer(handle, lineterminator="\r\n")  # upstream uses CRLF
        writer.writerow(AZURE_HEADER)
        for record in records:
            ticks = round(record.timestamp_s * 1e7)
            moment = midnight + dt.timedelta(seconds=ticks // 10**7)
            stamp = f"{moment:%Y-%m-%d %H:%M:%S}.{ticks % 10**7:07d}"
            writer.writerow((stamp, record.input_length, record.output_length))


def write_burstgpt(records: Iterable[TraceRecord], path: str | Path) -> None:
    """Write a BurstGPT CSV (v1.0 columns; ``Total tokens`` = request + response, model
    and log type from the record's tags, defaulting to ChatGPT / Conversation log)."""
    with _open_write(path) as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(BURSTGPT_HEADER)
        for record in records:
            stamp = record.timestamp_s
            writer.writerow(
                (
                    int(stamp) if stamp == int(stamp) else repr(stamp),
                    record.tags.get("model", "ChatGPT"),
                    record.input_length,
                    record.output_length,
                    record.input_length + record.output_length,
                    record.tags.get("log_type", "Conversation log"),
                )
            )
