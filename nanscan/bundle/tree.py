"""Nested structures with tensors inside (batches, optimizer state) as safetensors files plus a JSON skeleton."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanscan._atomic import FILE_MODE
from nanscan.bundle.format import BundleError, json_float


def _is_marker_dict(value: Mapping) -> bool:
    return any(isinstance(k, str) and k.startswith("__") for k in value)


class TreeEncoder:
    def __init__(self, separator: str):
        self.separator = separator
        self.tensors: dict[str, torch.Tensor] = {}

    def _name(self, path: Sequence[str]) -> str:
        name = self.separator.join(path) or "tensor"
        unique, n = name, 1
        while unique in self.tensors:
            n += 1
            unique = f"{name}#{n}"
        return unique

    def encode(self, value: Any, path: tuple[str, ...] = ()) -> Any:
        if isinstance(value, torch.Tensor):
            name = self._name(path)
            self.tensors[name] = value
            return {"__tensor__": name}
        if isinstance(value, np.ndarray) and value.dtype.kind in "fciub":
            name = self._name(path)
            self.tensors[name] = torch.from_numpy(np.ascontiguousarray(value))
            return {"__tensor__": name, "numpy": True}
        if value is None or isinstance(value, (bool, str, int)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": json_float(value)}
        if isinstance(value, np.generic):
            return self.encode(value.item(), path)
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value) and not _is_marker_dict(value):
                return {k: self.encode(v, path + (k,)) for k, v in value.items()}
            return {"__items__": [[self.encode(k), self.encode(v, path + (str(k),))] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, path + (str(i),)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, path + (str(i),)) for i, v in enumerate(value)]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # Read back as a plain dict: rebuilding the class would mean importing code named by the bundle.
            return {"__dataclass__": f"{type(value).__module__}.{type(value).__qualname__}",
                    "fields": {f.name: self.encode(getattr(value, f.name), path + (f.name,))
                               for f in dataclasses.fields(value)}}
        return {"__unstored__": f"{type(value).__module__}.{type(value).__qualname__}"}


def decode_tree(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [decode_tree(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        t = tensors[skeleton["__tensor__"]]
        return t.numpy() if skeleton.get("numpy") else t
    if "__float__" in skeleton:
        return float(skeleton["__float__"])
    if "__tuple__" in skeleton:
        return tuple(decode_tree(v, tensors) for v in skeleton["__tuple__"])
    if "__items__" in skeleton:
        return {decode_tree(k, tensors): decode_tree(v, tensors) for k, v in skeleton["__items__"]}
    if "__dataclass__" in skeleton:
        return {k: decode_tree(v, tensors) for k, v in skeleton["fields"].items()}
    if "__unstored__" in skeleton:
        return None
    return {k: decode_tree(v, tensors) for k, v in skeleton.items()}


def for_saving(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no memory (safetensors refuses shared storage, e.g. tied weights)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.numel():
            if not t.is_contiguous() or t.untyped_storage().data_ptr() in seen:
                t = t.clone(memory_format=torch.contiguous_format)
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file(for_saving(tensors), str(path), metadata=metadata)
    # safetensors creates its files 0600 whatever the umask: a bundle is evidence to share, like its JSON files
    os.chmod(path, FILE_MODE)


@contextlib.contextmanager
def reading_tensors(path: str | Path) -> Iterator[None]:
    """Turn a structural surprise while decoding a bundle file (a missing key, a wrong type, an index out of range)
    into a BundleError naming the file, instead of a traceback from deep inside the decoder."""
    try:
        yield
    except BundleError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise BundleError(f"{path} does not hold what its manifest describes ({type(exc).__name__}: {exc}); the "
                          "bundle is damaged or was edited, ask for a fresh copy") from None


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise BundleError(f"{path}: cannot read it as safetensors ({exc}); the bundle is damaged, "
                          "ask for a fresh copy") from exc


def tree_items(value: Any, path: tuple[str, ...] = ()):
    """(path, tensor) for every tensor in nested dicts/lists/tuples; keys become strings."""
    if isinstance(value, torch.Tensor):
        yield "/".join(path), value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from tree_items(v, path + (str(k),))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tree_items(v, path + (str(i),))


def map_tree(value: Any, fn, path: tuple[str, ...] = ()) -> Any:
    if isinstance(value, torch.Tensor):
        return fn("/".join(path), value)
    if isinstance(value, Mapping):
        return {k: map_tree(v, fn, path + (str(k),)) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(map_tree(v, fn, path + (str(i),)) for i, v in enumerate(value))
    return value
