"""Token counts for the `too_long` check: the default whitespace tokenizer (exactly `len(text.split())`) and a
HuggingFace `tokenizer.json` through the `tokenizers` package.

The whitespace count over an Arrow string column runs in one numba pass over the column's UTF-8 bytes when numba
is installed (about 0.9 GB/s here, several times `str.split`), and falls back to `str.split` per string
otherwise. Both count the same tokens: a test compares them on every whitespace code point Python knows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

# Every code point for which str.isspace() is true (what str.split() splits on), as UTF-8.
WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + \
    "\u2028\u2029\u202f\u205f\u3000"

# Byte classes for the numba kernel: 0 part of a token, 1 ASCII whitespace, 2 lead byte of a multi-byte
# sequence that may be whitespace (U+0085 and U+00A0 start with 0xC2, the others with 0xE1, 0xE2 or 0xE3).
_BYTE_CLASS = np.zeros(256, dtype=np.uint8)
for _ch in WHITESPACE:
    _encoded = _ch.encode("utf-8")
    _BYTE_CLASS[_encoded[0]] = 1 if len(_encoded) == 1 else 2

_kernel = None
_kernel_error: Exception | None = None


def _numba_kernel():
    global _kernel, _kernel_error
    if _kernel is None and _kernel_error is None:
        try:
            from nanscan.data._wordcount import count_words

            _kernel = count_words
        except Exception as exc:  # noqa: BLE001 - numba missing or broken: count with str.split instead
            _kernel_error = exc
    return _kernel


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(UTF-8 bytes, start offsets, end offsets) of a string array, honouring slices; a null is an empty string."""
    offset_type = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[arr.offset: arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    starts, ends = offsets[:-1], offsets[1:]
    if arr.null_count:
        # A null slot may point at arbitrary bytes.
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        starts = np.where(valid, starts, ends)
    return data, starts, ends


class WhitespaceTokenizer:
    """Tokens are maximal runs of non-whitespace characters, exactly as `str.split()` with no argument."""

    name = "whitespace"

    def count(self, texts: Sequence[str]) -> np.ndarray:
        return np.fromiter((len(t.split()) for t in texts), dtype=np.int64, count=len(texts))

    def count_arrow(self, arr: "pa.Array | pa.ChunkedArray") -> np.ndarray:
        if isinstance(arr, pa.ChunkedArray):
            parts = [self.count_arrow(c) for c in arr.chunks]
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(arr) == 0:
            return np.zeros(0, dtype=np.int64)
        kernel = _numba_kernel()
        if kernel is None:
            return self.count(["" if s is None else s for s in arr.to_pylist()])
        if not pa.types.is_string(arr.type) and not pa.types.is_large_string(arr.type):
            raise TypeError(f"count_arrow needs a string array, got {arr.type}")
        data, starts, ends = _string_buffers(arr)
        out = np.empty(len(arr), dtype=np.int64)
        kernel(data, starts, ends, _BYTE_CLASS, out)
        return out


class HFTokenizer:
    """A HuggingFace tokenizer from its tokenizer.json; counts include the special tokens the model sees."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = str(path)
        self.name = f"tokenizer.json:{Path(path).name}"
        self._tok = Tokenizer.from_file(self.path)

    def count(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.int64)
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=True)
        return np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(texts))

    def count_arrow(self, arr: "pa.Array | pa.ChunkedArray") -> np.ndarray:
        return self.count(["" if s is None else s for s in arr.to_pylist()])


class TokenizerError(ValueError):
    """A --tokenizer file that cannot be loaded."""


def load_tokenizer(spec) -> "WhitespaceTokenizer | HFTokenizer":
    """None or "whitespace" -> whitespace; a path -> HuggingFace tokenizer.json; an object with `count` -> itself."""
    if spec is None or spec == "whitespace":
        return WhitespaceTokenizer()
    if hasattr(spec, "count") and hasattr(spec, "count_arrow"):
        return spec
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {str(path)!r} does not exist; pass a HuggingFace tokenizer.json")
    try:
        return HFTokenizer(path)
    except Exception as exc:  # noqa: BLE001 - the tokenizers package raises plain Exceptions on bad files
        raise TokenizerError(f"cannot load tokenizer {str(path)!r} ({exc}); pass a HuggingFace tokenizer.json "
                             "(the file saved by tokenizer.save or found in a model repository)") from exc
