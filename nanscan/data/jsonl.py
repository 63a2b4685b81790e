"""JSON Lines (optionally gzip-compressed), streamed in blocks of whole lines with bounded memory.

Each block is parsed by Arrow's JSON reader and checked column by column (columnar.TableCheck);
only the lines that might hold a finding are parsed again with `json.loads` and checked one by one. A block Arrow
refuses (a line that is not valid JSON, a field whose type changes) is re-read in pieces, and refused pieces in
halves, until the bad lines are isolated, so one broken line does not send its neighbours down the slow path.

A record is one line; its identifier is the 1-based line number and the sha256 of the line's bytes without the
line feed. A line longer than --max-record-bytes is not loaded: it is reported `unreadable` and hashed in passing.
A UTF-8 byte order mark at the start of the file marks the encoding, as `json.loads` of bytes and Arrow take it: it
is not part of the first line.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.json as pj

from nanscan.data.checker import Checker, file_digest
from nanscan.data.columnar import TableCheck
from nanscan.data.findings import EMPTY, UNREADABLE, UTF8_BOM, RecordRef, sha256_hex
from nanscan.data.records import inspect_record

READ_BYTES = 8 << 20  # bytes read per step; a block is this plus the unfinished line carried over
ARROW_BLOCK = 4 << 20  # Arrow's own unit of parsing
PIECE_BYTES = 1 << 20  # a block Arrow refuses is re-read in pieces of about this size, in parallel
SPLIT_MIN = 16 << 10  # a refused piece is halved down to this size, then checked line by line
PARSE_AHEAD = 2  # blocks being parsed while one is checked: enough to keep two cores busy
# Arrow's JSON reader recurses once per nesting level and overflows the thread's stack (killing the process) near
# 10,000 levels. Deeper lines go to json.loads, which refuses them with a RecursionError (an `unreadable` finding)
# from about 1,000 levels, so this bound changes no result.
MAX_ARROW_DEPTH = 512
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class TruncatedStream(Exception):
    """A compressed stream that ends before its end marker."""


def _plain_chunks(path: Path, checker: Checker) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            checker.progress.advance(len(chunk))
            yield chunk


def _gzip_chunks(path: Path, checker: Checker) -> Iterator[bytes]:
    """Decompressed bytes of a (possibly multi-member) gzip file; everything before a truncation is yielded."""
    with open(path, "rb") as f:
        decompressor = zlib.decompressobj(wbits=31)
        in_member = False
        while raw := f.read(1 << 20):
            checker.progress.advance(len(raw))
            data = raw
            while data:
                in_member = True
                out = decompressor.decompress(data, READ_BYTES)
                if out:
                    yield out
                if decompressor.unconsumed_tail:
                    data = decompressor.unconsumed_tail
                elif decompressor.eof:
                    data = decompressor.unused_data  # the next member, if any
                    decompressor = zlib.decompressobj(wbits=31)
                    in_member = False
                else:
                    data = b""
        if in_member:
            raise TruncatedStream("the gzip stream ends before its end marker (the file is truncated)")


def is_gzip(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


class JsonLinesFile:
    """One JSON Lines file, checked block by block."""

    def __init__(self, checker: Checker, path: Path, display: str):
        self.checker = checker
        self.path = path
        self.display = display
        self.line = 0  # lines consumed so far
        self.string_fields: dict[str, pa.DataType] = {}  # top-level fields Arrow would read as timestamps

    # -- streaming ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        chunks = _gzip_chunks(self.path, self.checker) if is_gzip(self.path) else _plain_chunks(self.path,
                                                                                               self.checker)
        try:
            self._consume(chunks)
        except TruncatedStream as exc:
            self._file_finding(f"{exc}; the {self.line} lines before the break were checked")
        except zlib.error as exc:
            self._file_finding(f"corrupt gzip data after line {self.line} ({exc})")
        except OSError as exc:
            self._file_finding(f"cannot read the file after line {self.line} ({exc})")

    def _file_finding(self, detail: str) -> None:
        self.checker.sink.add(UNREADABLE, RecordRef(self.display, digest=lambda: file_digest(self.path)), detail)

    def _consume(self, chunks: Iterator[bytes]) -> None:
        """Cut the stream into blocks of whole lines; worker threads parse the next PARSE_AHEAD blocks with Arrow
        while this thread checks the current one (both release the GIL for most of their work)."""
        with ThreadPoolExecutor(max_workers=max(PARSE_AHEAD, os.cpu_count() or 1)) as pool:
            self._pool = pool
            pending: deque = deque()
            try:
                for item in self._blocks(chunks):
                    if isinstance(item, bytes):
                        pending.append(pool.submit(self._prepare, item))
                        if len(pending) > PARSE_AHEAD:
                            self._check(pending.popleft().result())
                    else:  # an over-long line: its number is known once the blocks before it are checked
                        while pending:
                            self._check(pending.popleft().result())
                        self._oversize(*item)
            finally:
                # Also when the stream breaks (a truncated gzip): what was read before the break is checked.
                while pending:
                    self._check(pending.popleft().result())

    def _blocks(self, chunks: Iterator[bytes]) -> Iterator["bytes | tuple[str, int]"]:
        """Blocks of whole lines, and (sha256, size) for each line over --max-record-bytes, skipped in passing."""
        limit = self.checker.max_record_bytes
        carry = b""
        skipping = None  # [sha256 object, bytes so far] while passing over an over-long line
        for chunk in _without_bom(chunks):
            if skipping is not None:
                nl = chunk.find(b"\n")
                if nl == -1:
                    skipping[0].update(chunk)
                    skipping[1] += len(chunk)
                    continue
                skipping[0].update(chunk[:nl])
                yield skipping[0].hexdigest(), skipping[1] + nl
                skipping, chunk = None, chunk[nl + 1:]
            data = carry + chunk if carry else chunk
            cut = data.rfind(b"\n")
            if cut == -1:
                carry = data
            else:
                yield data[: cut + 1]
                carry = data[cut + 1:]
            if len(carry) > limit:
                skipping = [hashlib.sha256(carry), len(carry)]
                carry = b""
        if skipping is not None:
            yield skipping[0].hexdigest(), skipping[1]
        elif carry:
            yield carry  # last line without a line feed

    def _oversize(self, digest: str, size: int) -> None:
        self.line += 1
        self.checker.records += 1
        self.checker.sink.add(UNREADABLE, RecordRef(self.display, line=self.line, digest=digest),
                              f"line of {size} bytes exceeds --max-record-bytes {self.checker.max_record_bytes}; "
                              "not parsed")

    # -- one block of whole lines --------------------------------------------------------------------------------
    def _prepare(self, block: bytes) -> "_Block":
        """Worker thread: find the lines, and parse each run of lines that begin with "{" with Arrow.

        Only such lines go to Arrow: its reader may crash the process on a line like `null`, so blank lines, bare
        values and over-long lines never reach it.
        """
        buf = np.frombuffer(block, dtype=np.uint8)
        newlines = np.flatnonzero(buf == 10)
        starts = np.concatenate([[0], newlines + 1])
        ends = np.concatenate([newlines, [len(block)]])
        if block.endswith(b"\n"):
            starts, ends = starts[:-1], ends[:-1]
        lengths = ends - starts
        lead = buf[np.minimum(starts, max(len(block) - 1, 0))] if len(block) else np.zeros(len(starts), np.uint8)
        objects = (lengths > 0) & (lead == ord("{")) & (lengths <= self.checker.max_record_bytes)
        # A line cannot nest deeper than it has opening brackets (nor bytes); only lines with many are measured.
        long_lines = objects & (lengths > MAX_ARROW_DEPTH)
        if long_lines.any() and block.count(b"[") + block.count(b"{") > MAX_ARROW_DEPTH:
            opening = np.flatnonzero((buf | 0x20) == ord("{"))  # "[" is 0x5b, "{" 0x7b; no other byte maps there
            counts = np.searchsorted(opening, ends) - np.searchsorted(opening, starts)
            for i in np.flatnonzero(long_lines & (counts > MAX_ARROW_DEPTH)).tolist():
                if nesting_depth(block[int(starts[i]):int(ends[i])]) > MAX_ARROW_DEPTH:
                    objects[i] = False
        edges = np.flatnonzero(np.diff(np.concatenate([[0], objects.view(np.int8), [0]])))
        runs = [(begin, end, self._parse(block[int(starts[begin]):int(ends[end - 1])]))
                for begin, end in zip(edges[0::2].tolist(), edges[1::2].tolist())]
        return _Block(block, starts, ends, np.flatnonzero(~objects).tolist(), runs)

    def _check(self, prepared: "_Block") -> None:
        block, starts, ends = prepared.block, prepared.starts, prepared.ends
        first_line = self.line + 1
        self.line += len(starts)
        self._slow(block, starts, ends, first_line, prepared.other_lines)
        for begin, end, table in prepared.runs:
            self._objects(block, starts[begin:end], ends[begin:end], first_line + begin, table)

    def _objects(self, block: bytes, starts: np.ndarray, ends: np.ndarray, first_line: int,
                 table: pa.Table | None) -> None:
        """A run of lines that each start with "{", with Arrow's table of it (None: refused). A refused run is cut
        into pieces and halved until the bad lines are isolated (a run of one line, or of under SPLIT_MIN bytes,
        is checked line by line)."""
        n = len(starts)
        if table is None or table.num_rows != n:  # refused, or a line held two records
            size = int(ends[-1] - starts[0])
            if n == 1 or size <= SPLIT_MIN:
                self._slow(block, starts, ends, first_line, range(n))
                return
            # A big run is cut into pieces first, so that several bad lines cost a few small re-reads each
            # rather than a cascade of halvings of the whole block.
            parts = max(2, size // PIECE_BYTES) if size > PIECE_BYTES else 2
            cuts = np.searchsorted(starts - starts[0], np.arange(1, parts) * (size / parts))
            inner = sorted({int(c) for c in cuts if 0 < c < n}) or [n // 2]  # lines can be longer than a piece
            bounds = list(zip([0, *inner], [*inner, n]))
            tables = self._pool.map(self._parse, [block[int(starts[b]):int(ends[e - 1])] for b, e in bounds])
            for (begin, end), piece in zip(bounds, tables):
                self._objects(block, starts[begin:end], ends[begin:end], first_line + begin, piece)
            return

        def ref(row: int) -> RecordRef:
            raw = block[starts[row]:ends[row]]
            return RecordRef(self.display, line=first_line + row, digest=sha256_hex(raw))

        def inspect_row(row: int) -> None:
            self._slow(block, starts, ends, first_line, [row])

        TableCheck(self.checker, table, ref, inspect_row).run()

    def _parse(self, data: bytes) -> pa.Table | None:
        try:
            # Arrow does not validate UTF-8 inside strings; json.loads of undecodable bytes is the definition.
            data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        try:
            table = self._read(data)
            retyped = {}
            for name, t in zip(table.column_names, table.schema.types):
                as_text = _timestamps_as_strings(t)
                if as_text is not None:
                    retyped[name] = as_text
            if retyped:
                # Arrow reads date-like strings as timestamps; json.loads keeps them strings. Read them as text.
                self.string_fields.update(retyped)
                table = self._read(data)
            return table
        except Exception:  # noqa: BLE001 - any refusal (invalid JSON, type change, bad UTF-8) means: slow path
            return None

    def _read(self, data: bytes) -> pa.Table:
        known = dict(self.string_fields)  # a snapshot: other threads may add fields meanwhile
        parse = pj.ParseOptions(explicit_schema=pa.schema(list(known.items())) if known else None,
                                unexpected_field_behavior="infer")
        # Single-threaded: the parse already runs beside the checks of the previous block, and Arrow's own thread
        # pool would only compete with them for the same cores (measured: a third more CPU per byte).
        return pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(block_size=ARROW_BLOCK, use_threads=False),
                            parse_options=parse)

    # -- the per-line definition ----------------------------------------------------------------------------------
    def _slow(self, block: bytes, starts: np.ndarray, ends: np.ndarray, first_line: int, which) -> None:
        checker = self.checker
        for i in which:
            raw = block[starts[i]:ends[i]]
            # Hashed now (cheap beside json.loads) so that pending scans never keep lines alive.
            ref = RecordRef(self.display, line=first_line + i, digest=sha256_hex(raw))
            if len(raw) > checker.max_record_bytes:
                checker.records += 1
                checker.sink.add(UNREADABLE, ref, f"line of {len(raw)} bytes exceeds --max-record-bytes "
                                                  f"{checker.max_record_bytes}; not parsed")
                continue
            check_json_line(checker, raw, ref)


@dataclass
class _Block:
    block: bytes
    starts: np.ndarray  # line i is block[starts[i]:ends[i]], without its line feed
    ends: np.ndarray
    other_lines: list[int]  # lines that are not candidates for Arrow (blank, bare values, over-long)
    runs: list  # (first line index, end line index, Arrow table or None) for runs of lines starting with "{"


def _without_bom(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The stream without a leading UTF-8 byte order mark (the first chunks may be shorter than the mark)."""
    head = b""
    for chunk in chunks:
        head += chunk
        if len(head) >= len(UTF8_BOM) or not UTF8_BOM.startswith(head):
            break
    if head:
        yield head[len(UTF8_BOM):] if head.startswith(UTF8_BOM) else head
    yield from chunks


def nesting_depth(line: bytes) -> int:
    """The deepest nesting of brackets outside strings. Exact up to the first syntax error, the part a parser
    reads; past it the count may be off, but no parser goes there."""
    structure = np.frombuffer(_JSON_STRING.sub(b'""', line), dtype=np.uint8)
    steps = ((structure == ord("[")) | (structure == ord("{"))).astype(np.int32)
    steps -= (structure == ord("]")) | (structure == ord("}"))
    return int(np.cumsum(steps).max(initial=0))


def _timestamps_as_strings(t: pa.DataType) -> pa.DataType | None:
    if pa.types.is_timestamp(t):
        return pa.string()
    if pa.types.is_list(t) and pa.types.is_timestamp(t.value_type):
        return pa.list_(pa.string())
    return None


def check_json_line(checker: Checker, raw: bytes, ref: RecordRef) -> None:
    """The definition for one JSON line: blank, undecodable, invalid, or a record for inspect_record."""
    if not raw.strip():
        checker.records += 1
        checker.sink.add(EMPTY, ref, "blank line")
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        checker.records += 1
        checker.sink.add(UNREADABLE, ref, f"not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}")
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        checker.records += 1
        checker.sink.add(UNREADABLE, ref, f"invalid JSON: {exc.msg} at column {exc.colno}")
        return
    except (ValueError, RecursionError) as exc:  # e.g. integers past Python's digit limit, absurd nesting
        checker.records += 1
        checker.sink.add(UNREADABLE, ref, f"JSON that Python cannot load: {type(exc).__name__}: {exc}")
        return
    inspect_record(checker, value, ref)


def check_jsonl(checker: Checker, path: Path, display: str) -> None:
    JsonLinesFile(checker, path, display).run()
