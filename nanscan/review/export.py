"""`nanscan export BUNDLE`: a bundle's whole history window (every tensor, every kept step, the failing one
included) as TensorBoard events (--tensorboard DIR) or as one tidy table (--csv / --parquet FILE) for pandas.

The table has one row per (step, tensor, stat): columns step (int64), tensor (string; empty for the step's own
scalars), stat (string) and value (float64). Per step: loss, lr and grad_norm (tensor empty, when recorded; the
gradient norm is NaN at a step whose gradients hold a NaN, inf where they hold only infinities, as in the
TensorBoard export: NOTE: [non-finite norms] in nanscan.integrations.live). Per tensor and step: numel, nan, posinf,
neginf, zero, subnormal, absmax, absmin, sumsq, and one `exp_hist:<e>` row per non-empty exponent bin, the count
of finite non-zero values with floor(log2|x|) = e (clamped to [-128, 127]). Counts are exact in float64 up to
2**53. Non-finite loss or sumsq values are NaN or inf, as they were recorded.

Every output is written under a temporary name and renamed into place when complete; an existing file or
non-empty directory is replaced only with --overwrite.
"""

from __future__ import annotations

import csv
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import click
import numpy as np

from nanscan.engine import _layout as L
from nanscan._atomic import TEMP_PREFIX, atomic_directory, atomic_write_with
from nanscan.incident import is_kind
from nanscan.cli.errors import CommandFailed, console

STATS = ("numel", "nan", "posinf", "neginf", "zero", "subnormal", "absmax", "absmin", "sumsq")
STEP_STATS = ("loss", "lr", "grad_norm")
COLUMNS = ("step", "tensor", "stat", "value")


def history_table(entries: Sequence[Any]) -> dict[str, list]:
    """The tidy table of a bundle's history entries (nanscan.bundle.HistoryEntry), as columns."""
    from nanscan.integrations.live import reported_norms  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    table: dict[str, list] = {column: [] for column in COLUMNS}

    def row(step: int, tensor: str, stat: str, value: float) -> None:
        table["step"].append(step)
        table["tensor"].append(tensor)
        table["stat"].append(stat)
        table["value"].append(float(value))

    for entry in entries:
        for stat in STEP_STATS:
            value = getattr(entry, stat)
            if value is not None and stat == "grad_norm":  # NOTE: [non-finite norms] in nanscan.integrations.live
                gradients = [s for s in entry.report.stats if is_kind(s.name, "gradient")]
                value = float(reported_norms(value, sum(s.nan for s in gradients),
                                             sum(s.posinf + s.neginf for s in gradients)))
            if value is not None:
                row(entry.step, "", stat, value)
        for stats in entry.report.stats:
            for stat in STATS:
                row(entry.step, stats.name, stat, getattr(stats, stat))
            for b in np.flatnonzero(stats.exp_hist):
                row(entry.step, stats.name, f"exp_hist:{int(b) + L.MIN_BIN_EXPONENT}", stats.exp_hist[b])
    return table


def _refuse_existing_file(path: Path, overwrite: bool) -> None:
    if path.is_dir():
        raise CommandFailed(f"{path} is a directory; give a file name for the table")
    if path.exists() and not overwrite:
        raise CommandFailed(f"{path} exists; pass --overwrite to replace it, or choose another name")


def write_csv(table: dict[str, list], path: Path) -> None:
    def write(temp: Path) -> None:
        with open(temp, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(COLUMNS)
            # repr: the shortest text that reads back as the same float64 (csv's str() would be the same today)
            out.writerows(zip(table["step"], table["tensor"], table["stat"], map(repr, table["value"])))

    atomic_write_with(path, write)


def write_parquet(table: dict[str, list], path: Path) -> None:
    try:
        import pyarrow as pa  # noqa: PLC0415 - an optional dependency (nanscan[data])
        import pyarrow.parquet as pq  # noqa: PLC0415
    except ImportError as exc:
        raise CommandFailed(f"--parquet needs pyarrow ({exc}); install it with `pip install pyarrow`, or use "
                            "--csv") from None
    arrow = pa.table({"step": pa.array(table["step"], pa.int64()), "tensor": pa.array(table["tensor"], pa.string()),
                      "stat": pa.array(table["stat"], pa.string()), "value": pa.array(table["value"], pa.float64())})
    atomic_write_with(path, lambda temp: pq.write_table(arrow, temp))


def write_tensorboard(entries: Sequence[Any], directory: Path, *, overwrite: bool) -> None:
    """Every entry's scalars, every tensor's histogram and every module's gradient norm as TensorBoard events in
    `directory` (built under a temporary name, then renamed into place)."""
    from nanscan.integrations.live import step_row  # noqa: PLC0415 - NOTE: [fast help]
    from nanscan.integrations.tensorboard import EVENT_FILE_PREFIX, TensorBoardSink  # noqa: PLC0415

    old = None
    if directory.exists():
        if not directory.is_dir():
            raise CommandFailed(f"{directory} is a file, not a directory; give a directory for the events")
        held = sorted(p.name for p in directory.iterdir())
        if held and not overwrite:
            raise CommandFailed(f"{directory} is not empty; pass --overwrite to replace it, or choose another "
                                "directory")
        strangers = [name for name in held if not name.startswith(EVENT_FILE_PREFIX)]
        if strangers:
            raise CommandFailed(f"{directory} holds more than TensorBoard event files ({', '.join(strangers[:3])}"
                                f"{', ...' if len(strangers) > 3 else ''}); --overwrite replaces only a directory of "
                                "event files: choose another directory")
        old = directory
    # Replacing: the new events are built beside the old ones and swapped in only once complete.
    staging = directory if old is None else \
        Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{directory.name}-new-", dir=directory.parent)) / directory.name
    try:
        with atomic_directory(staging) as temp:
            sink = TensorBoardSink(temp)
            try:
                sink.write([step_row(e.step, e.report.tensors, e.report.records, loss=e.loss, lr=e.lr,
                                     histograms=range(len(e.report.tensors)), module_norms=True) for e in entries])
            finally:
                sink.close()
    except BaseException:
        if old is not None:  # the staging directory's parent, made for the swap below
            shutil.rmtree(staging.parent, ignore_errors=True)
        raise
    if old is not None:
        trash = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{directory.name}-old-", dir=directory.parent))
        os.replace(directory, trash / directory.name)
        os.replace(staging, directory)
        shutil.rmtree(trash, ignore_errors=True)
        shutil.rmtree(staging.parent, ignore_errors=True)


@click.command("export")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(exists=True, path_type=Path))
@click.option("--tensorboard", "tb_dir", type=click.Path(path_type=Path),
              help="Write the history as TensorBoard events into this directory (new or empty).")
@click.option("--csv", "csv_out", type=click.Path(path_type=Path),
              help="Write the history as one table (step, tensor, stat, value) to this CSV file.")
@click.option("--parquet", "parquet_out", type=click.Path(path_type=Path),
              help="Write the same table to this Parquet file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file, or a directory of event files.")
def export_command(bundle_path, tb_dir, csv_out, parquet_out, overwrite):
    """Write BUNDLE's history window (every tensor, every kept step) as TensorBoard events, CSV or Parquet."""
    from nanscan.bundle import BundleError, load_bundle  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py
    from nanscan.review.summary import bundle_holding, load_history  # noqa: PLC0415

    outputs = [(flag, path) for flag, path in (("--tensorboard", tb_dir), ("--csv", csv_out),
                                               ("--parquet", parquet_out)) if path is not None]
    if not outputs:
        raise click.UsageError("say what to write: --tensorboard DIR, --csv FILE and/or --parquet FILE")
    for flag, path in outputs:
        if flag != "--tensorboard":
            _refuse_existing_file(path, overwrite)
    try:
        bundle = load_bundle(bundle_path)
        entries = load_history(bundle)
    except BundleError as exc:
        raise CommandFailed(f"cannot read the bundle {bundle_path}: {exc}") from None
    for flag, path in outputs:
        inside = bundle_holding(bundle, path)
        if inside is not None:
            raise CommandFailed(f"{flag} {path} is inside the bundle {inside}: a file the manifest does not list "
                                "makes the bundle fail to load; write it elsewhere")
    out = console()
    table = history_table(entries) if csv_out is not None or parquet_out is not None else None
    writes = [("--tensorboard", tb_dir, lambda: write_tensorboard(entries, tb_dir, overwrite=overwrite),
               lambda: f"tensorboard: {tb_dir} ({len(entries)} steps; `tensorboard --logdir {tb_dir}`)"),
              ("--csv", csv_out, lambda: write_csv(table, csv_out), lambda: f"csv: {csv_out} ({len(table['step'])} rows)"),
              ("--parquet", parquet_out, lambda: write_parquet(table, parquet_out),
               lambda: f"parquet: {parquet_out} ({len(table['step'])} rows)")]
    for flag, path, write, said in writes:
        if path is None:
            continue
        try:
            write()
        except OSError as exc:  # a full disk, an I/O error, a read-only directory: every write here is atomic
            raise CommandFailed(f"cannot write {flag} {path} ({type(exc).__name__}: {exc}); nothing partial was "
                                "left there (outputs listed above were written); free space or choose another "
                                "place") from None
        out.print(said(), markup=False, highlight=False)
