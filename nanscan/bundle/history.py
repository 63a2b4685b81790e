"""The history window on disk: every kept step's stats records in history.safetensors, its scalars in history.json
(with, under a GradScaler, the scale its gradients carried and whether it was an overflow skip; bundles written
before these keys load as without a scaler)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from nanscan import _layout as L
from nanscan.bundle.format import HISTORY_INDEX, BundleError, HistoryEntry, float_from_json, is_int, json_float
from nanscan.stats import ScannedTensor, ScanReport, Scaling


def history_payload(entries: Sequence[HistoryEntry]) -> tuple[dict[str, torch.Tensor], dict]:
    """Records of every entry stacked into one array; entries with the same tensor list share one layout."""
    layouts: list[dict] = []
    layout_index: dict[tuple, int] = {}
    rows, offsets, index_entries = [], [0], []
    for entry in entries:
        report = entry.report
        key = (tuple((t.name, t.dtype, t.device, t.numel, t.scanned_code) for t in report.tensors),
               tuple(report.skipped))
        if key not in layout_index:
            layout_index[key] = len(layouts)
            layouts.append({
                "names": [t.name for t in report.tensors], "dtypes": [t.dtype for t in report.tensors],
                "devices": [t.device for t in report.tensors], "numels": [t.numel for t in report.tensors],
                "scanned_codes": [t.scanned_code for t in report.tensors], "skipped": list(report.skipped),
            })
        rows.append(report.records)
        offsets.append(offsets[-1] + len(report.records))
        index_entries.append({"step": entry.step, "loss": json_float(entry.loss), "lr": json_float(entry.lr),
                              "grad_norm": json_float(entry.grad_norm), "layout": layout_index[key],
                              "backend": report.backend, **_scaler_fields(report)})
    records = np.concatenate(rows) if rows else L.empty_records(0)
    tensors = {"records": torch.from_numpy(np.ascontiguousarray(records)),
               "row_offsets": torch.tensor(offsets, dtype=torch.int64)}
    index = {"record_width": L.RECORD_WIDTH, "entries": index_entries, "layouts": layouts}
    return tensors, index


def _scaler_fields(report: ScanReport) -> dict:
    """A step's GradScaler keys (none without a scaler): the records stay scaled, the reader unscales them again
    (NOTE: [unscaled gradients] in nanscan.stats)."""
    if report.scaling is None:
        return {}
    return {"scale": json_float(report.scaling.scale), "grads_scaled": report.scaling.scaled,
            "backoff": report.scaling.backoff, "overflow_skip": report.overflow_skip}


def _scaling_from(entry: Mapping, i: int) -> tuple[Scaling | None, bool]:
    """The Scaling and overflow-skip flag of a stored entry; (None, False) for one without (older bundles too)."""
    if "scale" not in entry:
        return None, False
    scale, scaled, backoff, skip = (entry.get(k) for k in ("scale", "grads_scaled", "backoff", "overflow_skip"))
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and isinstance(scaled, bool)
            and isinstance(skip, bool) and isinstance(backoff, (int, float))):
        raise ValueError(f"entry {i} (step {entry.get('step')}) has scale {scale!r}, grads_scaled {scaled!r}, "
                         f"backoff {backoff!r}, overflow_skip {skip!r}")
    return Scaling(float(scale), scaled, backoff=float(backoff)), skip


_JSON_FLOAT_STRINGS = ("nan", "inf", "-inf")


def history_from_payload(tensors: Mapping[str, torch.Tensor], index: Mapping) -> list[HistoryEntry]:
    """HistoryEntries from the stored records and index; raises ValueError (or another structural error) for a
    payload the writer could not have produced, so a damaged file never yields plausible-looking statistics."""
    if not isinstance(index, dict):
        raise ValueError(f"{HISTORY_INDEX} holds a {type(index).__name__}, not an object")
    if index.get("record_width") != L.RECORD_WIDTH:
        raise BundleError(f"{HISTORY_INDEX}: records are {index.get('record_width')} slots wide, this nanscan "
                          f"reads {L.RECORD_WIDTH}; use the nanscan version that wrote the bundle")
    records, row_offsets = tensors["records"], tensors["row_offsets"]
    if records.dtype != torch.int64 or records.dim() != 2 or records.shape[1] != L.RECORD_WIDTH:
        raise ValueError(f"records are {records.dtype} {tuple(records.shape)}, expected int64 (n, {L.RECORD_WIDTH})")
    records = records.numpy()
    if (records[:, :L.REC_ABSMAX_BITS] < 0).any() or (records[:, L.REC_HIST:] < 0).any():
        raise ValueError("records hold negative counts")
    entries, layouts = index["entries"], index["layouts"]
    if row_offsets.dtype != torch.int64 or row_offsets.dim() != 1:
        raise ValueError(f"row_offsets are {row_offsets.dtype} {tuple(row_offsets.shape)}, expected int64 (n,)")
    offsets = row_offsets.tolist()
    if (len(offsets) != len(entries) + 1 or offsets[0] != 0 or offsets[-1] != len(records)
            or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"row_offsets {offsets[:4]}... do not split {len(records)} records into {len(entries)} steps")
    out = []
    for i, entry in enumerate(entries):
        if not is_int(entry["layout"]) or not 0 <= entry["layout"] < len(layouts) or not is_int(entry["step"]):
            raise ValueError(f"entry {i} has layout {entry['layout']!r} and step {entry['step']!r}")
        layout = layouts[entry["layout"]]
        columns = [layout[k] for k in ("names", "dtypes", "devices", "numels", "scanned_codes")]
        if len({len(c) for c in columns}) != 1 or any(code not in L.DTYPE_NAMES for code in layout["scanned_codes"]):
            raise ValueError(f"layout {entry['layout']} has columns of different lengths or unknown dtype codes")
        scanned = [ScannedTensor(*fields) for fields in zip(*columns)]
        values = [entry[k] for k in ("loss", "lr", "grad_norm")]
        if not all(v is None or is_int(v) or isinstance(v, float) or v in _JSON_FLOAT_STRINGS for v in values):
            raise ValueError(f"entry {i} (step {entry['step']}) has loss, lr, grad_norm {values}")
        scaling, overflow_skip = _scaling_from(entry, i)
        report = ScanReport(scanned, records[offsets[i]:offsets[i + 1]].copy(), skipped=layout["skipped"],
                            backend=entry["backend"], step=entry["step"], scaling=scaling,
                            overflow_skip=overflow_skip)
        out.append(HistoryEntry(entry["step"], *map(float_from_json, values), report))
    return out
