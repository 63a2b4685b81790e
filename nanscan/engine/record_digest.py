"""The digest a record is known by wherever it moves: sha256 of a canonical encoding of a Python value (the data
checks' rule for records with no byte form of their own, the quarantine's match: NOTE: [quarantine match] in
nanscan.data.quarantine), and of each row of a batch that collation stacked from such records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from nanscan.engine.inputs import iter_batch_tensors, map_tensors

def digest_object(value: Any) -> str:
    """sha256 of a canonical, type-tagged encoding of a Python value (mappings by sorted key, arrays as dtype,
    shape and C-order bytes), for records that have no byte form of their own (Parquet rows, Python datasets)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    def put(tag: bytes, payload: bytes) -> None:
        h.update(tag + len(payload).to_bytes(8, "little") + payload)

    if value is None:
        put(b"N", b"")
    elif isinstance(value, (bool, np.bool_)):
        put(b"B", b"1" if value else b"0")
    elif isinstance(value, (int, np.integer)):
        put(b"I", str(int(value)).encode())
    elif isinstance(value, (float, np.floating)):
        put(b"F", float(value).hex().encode())
    elif isinstance(value, str):
        put(b"S", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        put(b"Y", bytes(value))
    elif isinstance(value, Mapping):
        items = sorted(((str(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        put(b"D", str(len(items)).encode())
        for k, v in items:
            put(b"K", k.encode("utf-8", "surrogatepass"))
            _feed(h, v)
    elif isinstance(value, (list, tuple)):
        put(b"L", str(len(value)).encode())
        for v in value:
            _feed(h, v)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.dim() and t.numel() else t.reshape(-1).view(torch.uint8)
        put(b"T", f"{t.dtype}{tuple(t.shape)}".encode())
        put(b"R", raw.numpy().tobytes())
    elif isinstance(value, np.ndarray):
        put(b"A", f"{value.dtype.str}{value.shape}".encode())
        put(b"R", np.ascontiguousarray(value).tobytes())
    elif is_pil_image(value):
        put(b"P", f"{value.mode}{value.size}".encode())
        put(b"R", value.tobytes())
    else:
        put(b"O", f"{type(value).__qualname__}:{value!r}".encode("utf-8", "surrogatepass"))


def is_pil_image(value: Any) -> bool:
    """A PIL image, recognised without importing PIL."""
    cls = type(value)
    return cls.__module__.startswith("PIL.") and hasattr(value, "mode") and hasattr(value, "getbands")


def _only_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return bool(value) and all(_only_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_only_tensors(v) for v in value)
    return False


def row_digests(batch: Any, rows: list[int], size: int | None) -> tuple[list[str] | None, str]:
    """The digest of each named row of a batch (digest_object of every tensor indexed at the row): the record the
    row came from, for a batch of tensors that all hold one row per sample (what collation stacks from records of
    tensors); else (None, why). Reads the rows on the host."""
    if batch is None or size is None:
        return None, "the batch is not kept"
    if not _only_tensors(batch):
        return None, "the batch holds values other than tensors, so a row is not the record it came from"
    if any(t.dim() == 0 or t.shape[0] != size for _, t in iter_batch_tensors(batch)):
        return None, f"not every tensor of the batch has one row per sample ({size})"
    return [digest_object(map_tensors(batch, lambda t, i=i: t[i])) for i in rows], ""
