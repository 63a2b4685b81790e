"""Parquet files, read by record batches and checked with the columnar fast path (columnar.TableCheck).

A record is a row; its identifier is the 0-based row index and the sha256 of a canonical encoding of the row's
values (nanscan.engine.record_digest.digest_object), since a row has no byte form of its own.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from nanscan.data.checker import Checker, file_ref
from nanscan.data.columnar import TableCheck
from nanscan.data.findings import UNREADABLE, RecordRef
from nanscan.data.records import inspect_record
from nanscan.engine.record_digest import digest_object

PARQUET_BATCH_ROWS = 64 << 10


def check_parquet(checker: Checker, path: Path, size: int) -> None:
    """Check one Parquet file of `size` bytes, advancing the progress by the share of rows read."""
    import pyarrow.parquet as pq  # deferred: only a check that meets a Parquet file needs Arrow's Parquet reader

    display = str(path)
    try:
        pf = pq.ParquetFile(path)
        total_rows = pf.metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - ArrowInvalid, OSError, ... : not a readable Parquet file
        checker.progress.advance(size)
        checker.sink.add(UNREADABLE, file_ref(path), f"not a readable Parquet file ({exc})")
        return
    base = 0
    advanced = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            table = pa.Table.from_batches([batch])
            offset = base

            def ref(i: int, table=table, offset=offset) -> RecordRef:
                return RecordRef(display, index=offset + i,
                                 digest=lambda: digest_object(table.slice(i, 1).to_pylist()[0]))

            def inspect_row(i: int, table=table, offset=offset) -> None:
                row_ref = ref(i)
                try:
                    row = table.slice(i, 1).to_pylist()[0]
                except Exception as exc:  # noqa: BLE001 - e.g. invalid UTF-8 stored in a string column
                    checker.records += 1
                    checker.sink.add(UNREADABLE, RecordRef(display, index=offset + i),
                                     f"row cannot be converted ({type(exc).__name__}: {exc})")
                    return
                inspect_record(checker, row, row_ref)

            TableCheck(checker, table, ref, inspect_row).run()
            base += batch.num_rows
            step = size * base // max(total_rows, 1) - advanced
            checker.progress.advance(step)
            advanced += step
    except Exception as exc:  # noqa: BLE001 - corrupt pages, bad compression, truncated row groups
        checker.sink.add(UNREADABLE, file_ref(path), f"Parquet data unreadable after row {base} ({exc})")
    checker.progress.advance(size - advanced)
