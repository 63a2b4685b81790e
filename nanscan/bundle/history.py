"""The history window on disk: every kept step's stats records in history.safetensors, its scalars in history.json
(with, under a GradScaler, the scale its gradients carried and whether it was an overflow skip; bundles written
before these keys load as without a scaler).

NOTE: [sparse history records]
The records are stored as RECORDS_FORMAT: the compact records of every kept step (NOTE: [compact records] in
csrc/include/nanscan/compact.h; nanscan.engine.compact), not the dense int64 (rows, RECORD_WIDTH) array (2.1 KB per
tensor-step). history.safetensors holds
  "scalars"      int64 (rows, SCALAR_WIDTH): the slots outside the histogram, as they are (those before it, then the
                 fingerprint after it);
  "hist_ranges"  int16 (rows, 2): each row's first occupied bin and width ((0, 0) for an empty histogram);
  "hist_counts"  the counts of those ranges in row order, in the narrowest of uint8/16/32/64 that holds them all;
  "row_offsets"  int64 (steps + 1,): where each step's rows start, as before.
Ranges are trimmed to the first and last nonzero bin, so the same entries give the same bytes; the reader accepts
any range that fits and decodes to exactly the original int64 records. An index without
"records_format" is a bundle written before it: its dense "records" array still loads.
An index whose "record_width" is RECORD_WIDTH_WITHOUT_FINGERPRINT (264) is a bundle written before records carried
the fingerprint (NOTE: [scan fingerprint] in csrc/include/nanscan/stats_record.h): its scalars (or dense records)
stop at the histogram's end, and its reports load with fingerprinted=False, so every TensorStats.fingerprint is None:
absent, never a fingerprint of 0.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine import compact
from nanscan.bundle.format import HISTORY_INDEX, BundleError, HistoryEntry, float_from_json, is_int, json_float
from nanscan.engine.stats import ScannedTensor, ScanReport, Scaling


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
    # Entries read from a bundle without fingerprints are written without them again: absent stays absent.
    fingerprinted = all(entry.report.fingerprinted for entry in entries)
    encoded = encode_records(records)
    if not fingerprinted:
        encoded["scalars"] = encoded["scalars"][:, :L.REC_HIST].contiguous()
    tensors = {**encoded, "row_offsets": torch.tensor(offsets, dtype=torch.int64)}
    width = L.RECORD_WIDTH if fingerprinted else L.RECORD_WIDTH_WITHOUT_FINGERPRINT
    index = {"record_width": width, "records_format": RECORDS_FORMAT, "entries": index_entries, "layouts": layouts}
    return tensors, index


RECORDS_FORMAT = "sparse-hist/1"
_PAYLOAD_KEYS = ("scalars", "hist_ranges", "hist_counts")


def encode_records(records: np.ndarray) -> dict[str, torch.Tensor]:
    """The int64 (rows, RECORD_WIDTH) records as sparse-histogram tensors (NOTE: [sparse history records])."""
    return dict(zip(_PAYLOAD_KEYS, map(torch.from_numpy, compact.encode(records))))


def decode_records(tensors: Mapping[str, torch.Tensor], *, fingerprinted: bool = True) -> np.ndarray:
    """The int64 records back from encode_records' tensors; ValueError naming the tensor for a payload whose
    shapes, ranges or counts do not fit together. `fingerprinted`: False for scalars written before the fingerprint
    (they stop at the histogram; its slot decodes as 0)."""
    slots = L.SCALAR_SLOTS if fingerprinted else np.arange(L.REC_HIST)
    return compact.decode(*(tensors[k].numpy() for k in _PAYLOAD_KEYS), scalar_slots=slots)


def _stored_records(tensors: Mapping[str, torch.Tensor], index: Mapping, fingerprinted: bool) -> np.ndarray:
    """The int64 records of either encoding: RECORDS_FORMAT, or the dense array of a bundle written before it;
    records stored without the fingerprint get its slot, 0."""
    stored_format = index.get("records_format")
    if stored_format == RECORDS_FORMAT:
        return decode_records(tensors, fingerprinted=fingerprinted)
    if stored_format is not None:
        raise BundleError(f"{HISTORY_INDEX}: records are stored as {stored_format!r}, this nanscan reads "
                          f"{RECORDS_FORMAT!r} and the dense records of older bundles; use the nanscan version "
                          "that wrote the bundle")
    records = tensors["records"]
    width = L.RECORD_WIDTH if fingerprinted else L.RECORD_WIDTH_WITHOUT_FINGERPRINT
    if records.dtype != torch.int64 or records.dim() != 2 or records.shape[1] != width:
        raise ValueError(f"records are {records.dtype} {tuple(records.shape)}, expected int64 (n, {width})")
    if fingerprinted:
        return records.numpy()
    out = L.empty_records(records.shape[0])
    out[:, :width] = records.numpy()
    out[:, L.REC_FINGERPRINT] = 0
    return out


def _scaler_fields(report: ScanReport) -> dict:
    """A step's GradScaler keys (none without a scaler): the records stay scaled, the reader unscales them again
    (NOTE: [unscaled gradients] in nanscan.engine.stats)."""
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
    width = index.get("record_width")
    if width not in (L.RECORD_WIDTH, L.RECORD_WIDTH_WITHOUT_FINGERPRINT):
        raise BundleError(f"{HISTORY_INDEX}: records are {width} slots wide, this nanscan reads "
                          f"{L.RECORD_WIDTH} (and {L.RECORD_WIDTH_WITHOUT_FINGERPRINT}, without fingerprints); use "
                          "the nanscan version that wrote the bundle")
    fingerprinted = width == L.RECORD_WIDTH
    records, row_offsets = _stored_records(tensors, index, fingerprinted), tensors["row_offsets"]
    if (records[:, :L.REC_ABSMAX_BITS] < 0).any() or (records[:, L.REC_HIST:L.REC_HIST_END] < 0).any():
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
                            overflow_skip=overflow_skip, fingerprinted=fingerprinted)
        out.append(HistoryEntry(entry["step"], *map(float_from_json, values), report))
    return out
