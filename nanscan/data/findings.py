"""What a dataset check reports: findings with stable record identifiers, the token-length distribution, the
boundary records, the per-field type/shape tallies that decide which records are inconsistent, and which fields
hold token ids, labels and a loss mask.

Everything here is bounded in memory whatever the input size: counts are exact, but only the first
`max_findings` findings of each category are kept for listing, token lengths are kept as a histogram, and each
field keeps a capped sample of record identifiers per distinct type/shape.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

# NOTE: [overflow] in nanscan/engine/headroom.py: the Monitor's rule too, so data checks and incidents agree.
from nanscan.engine.headroom import OVERFLOW_EXPONENT
# NOTE: [no supervised tokens] in nanscan/engine/targets.py: the rule an incident's batch is judged by too.
from nanscan.engine.targets import DEFAULT_IGNORE_INDEX

NONFINITE = "nonfinite"
OVERFLOW = "overflow"
EMPTY = "empty"
TOO_LONG = "too_long"
NO_SUPERVISED_TOKENS = "no_supervised_tokens"  # NOTE: [no supervised tokens]
CORRUPT_IMAGE = "corrupt_image"
UNREADABLE = "unreadable"
INCONSISTENT = "inconsistent"
CATEGORIES = (NONFINITE, OVERFLOW, EMPTY, TOO_LONG, NO_SUPERVISED_TOKENS, CORRUPT_IMAGE, UNREADABLE, INCONSISTENT)
# A long record is worth knowing about but is often truncated on purpose by the loader, so by default it does not
# fail a check.
DEFAULT_FAIL_ON = tuple(c for c in CATEGORIES if c != TOO_LONG)
EXIT_CODES = {"clean": 0, "findings": 1, "unreadable": 3}

# no_supervised_tokens: labels all the ignore index, or a loss mask all 0 (NOTE: [no supervised tokens] in
# nanscan/engine/targets.py); one finding per such field of a record.
DEFAULT_TOKEN_FIELDS = ("input_ids",)
DEFAULT_LABELS_FIELD = "labels"
DEFAULT_LOSS_MASK_FIELD = "loss_mask"


@dataclass(frozen=True)
class TrainingFields:
    """The fields a training loop reads as tokens: `token_fields` hold token ids already (a list of ints; a record
    with one counts its length as its tokens, in place of its text), `labels_field` the targets (NOTE: [no
    supervised tokens]: all equal to `ignore_index`), `loss_mask_field` a 0/1 mask (all 0). None: no such field."""

    token_fields: tuple[str, ...] = DEFAULT_TOKEN_FIELDS
    labels_field: str | None = DEFAULT_LABELS_FIELD
    ignore_index: int = DEFAULT_IGNORE_INDEX
    loss_mask_field: str | None = DEFAULT_LOSS_MASK_FIELD

    def __post_init__(self):
        if isinstance(self.token_fields, str):
            raise TypeError(f"token_fields={self.token_fields!r}: give a tuple of field names, e.g. "
                            f"({self.token_fields!r},)")
        object.__setattr__(self, "token_fields", tuple(self.token_fields))
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
            raise TypeError(f"ignore_index={self.ignore_index!r}: give the integer label the loss ignores (-100 for "
                            "torch's cross_entropy)")

    def to_dict(self) -> dict:
        return {"token_fields": list(self.token_fields), "labels_field": self.labels_field,
                "ignore_index": self.ignore_index, "loss_mask_field": self.loss_mask_field}

    def list_fields(self) -> frozenset[str]:
        """The fields whose values are lists of numbers: in a CSV file, a cell of them is a JSON list."""
        return frozenset(f for f in (*self.token_fields, self.labels_field, self.loss_mask_field) if f)


def _float32_text(value: float) -> float:
    """How a float32 value reads back from text written by its shortest decimal (e.g. 3.4028235e+38)."""
    return float(str(np.float32(value)))


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_BFLOAT16_MAX = (2 - 2.0 ** -7) * 2.0 ** 127
# Export tools write a format's largest value for "missing". In text files (JSON Lines, CSV) a float32 column is
# usually written by its shortest decimal, which reads back as a float64 next to the maximum, not on it.
FORMAT_MAXIMA = {
    float(np.finfo(np.float64).max): "float64",
    _FLOAT32_MAX: "float32", _float32_text(_FLOAT32_MAX): "float32",
    _BFLOAT16_MAX: "bfloat16", _float32_text(_BFLOAT16_MAX): "bfloat16",
}


def overflow_detail(count: int, listed: list[str], largest: float) -> str:
    """The detail of an `overflow` finding: `count` values, the first of them `listed` ("3.403e+38 at w[0]"),
    `largest` the one of largest magnitude (its sign kept)."""
    shown = listed[:5]
    detail = (f"{count} value{'s' if count != 1 else ''} with |x| >= 2**{OVERFLOW_EXPONENT} "
              f"({'their squares overflow' if count != 1 else 'its square overflows'} float32): " + ", ".join(shown))
    if count > len(shown):
        detail += f" and {count - len(shown)} more"
    fmt = FORMAT_MAXIMA.get(abs(largest))
    if fmt is not None:
        which = f"the largest, {largest:.8g}," if count != 1 else f"{largest:.8g}"
        detail += f"; {which} is {'minus ' if largest < 0 else ''}the {fmt} maximum, a common missing-value sentinel"
    return detail

# A type that differs from the most common one is reported when the most common covers more than half of the
# records. Shapes and presence vary legitimately (token lists, optional keys), so a shape or a missing key is
# reported only when the field is nearly uniform: at least this share of its records agree.
UNIFORM_SHARE = 0.9
# Record identifiers kept per distinct (type, shape) of a field, and per field in all: enough to name every
# record of a rare variant, bounded when a field takes thousands of distinct shapes.
SAMPLES_PER_SIGNATURE = 100
SAMPLES_PER_FIELD = 20_000
# Bounds on what is tallied, so that records with ever-new field names or shapes cannot grow memory without end:
# past them, new fields and key sets are not compared, and a field's new shapes are tallied without the shape.
MAX_FIELDS = 10_000
MAX_KEYSETS = 10_000
MAX_VARIANTS_PER_FIELD = 10_000
# The field name under which a record that is not a mapping or a tuple (a bare array, a JSON list) is tallied,
# and under which every record's own kind ("object" for a mapping) is compared.
ROOT_FIELD = "(record)"


# The UTF-8 byte order mark. At the start of a text file (JSON Lines, CSV) it marks the encoding, as json.loads of
# bytes and Arrow take it: it is no part of the first record, nor of its digest.
UTF8_BOM = b"\xef\xbb\xbf"


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class RecordId:
    """A stable name for one record: where it is, and the sha256 of its bytes.

    `line` is 1-based (text formats); `index` is 0-based (rows of columnar files and arrays, positions in a
    Python dataset); `member` names the array inside an .npz or safetensors file. The digest covers the record's
    bytes as stored (a JSON line without its newline, a CSV record's lines, an image file, an array row in C
    order); for Parquet rows and Python objects, which have no byte form of their own, it covers a canonical
    encoding (see `nanscan.engine.record_digest.digest_object`).
    """

    file: str
    line: int | None = None
    index: int | None = None
    member: str | None = None
    sha256: str | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
        if self.member is not None:
            where += f":{self.member}"
        if self.index is not None:
            where += f"[{self.index}]"
        return where

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "index": self.index, "member": self.member,
                "sha256": self.sha256}


class RecordRef:
    """A record's location with its digest computed only when asked (most records never need one)."""

    __slots__ = ("file", "line", "index", "member", "lazy", "_digest", "_id")

    def __init__(self, file: str, *, line: int | None = None, index: int | None = None, member: str | None = None,
                 digest: "str | Callable[[], str | None] | None" = None, lazy: bool = False):
        """`lazy=True` says the digest function holds nothing large (e.g. it re-reads a file by name), so the
        reference may be kept unresolved until a finding needs it."""
        self.file, self.line, self.index, self.member = file, line, index, member
        self.lazy = lazy
        self._digest = digest
        self._id: RecordId | None = None

    def id(self) -> RecordId:
        if self._id is None:
            digest = self._digest() if callable(self._digest) else self._digest
            self._id = RecordId(self.file, self.line, self.index, self.member, digest)
            self._digest = None  # drop what the digest was computed from (it may be a large record)
        return self._id


@dataclass(frozen=True)
class Finding:
    """One problem in one record (or in one field of it)."""

    category: str
    record: RecordId
    detail: str
    field: str | None = None
    sample_id: Any = None  # the record's --id-field value (nanscan.data.ids), when asked for and found

    def to_dict(self) -> dict:
        out = {"category": self.category, "record": str(self.record), **self.record.to_dict(),
               "field": self.field, "detail": self.detail}
        if self.sample_id is not None:
            out["sample_id"] = self.sample_id
        return out


# Inputs (files, archive members) that could not be read through, listed by name; all are counted.
MAX_UNREADABLE_INPUTS_LISTED = 100


class FindingSink:
    """Exact counts per category; the first `max_findings` findings of each category kept for listing.

    An `unreadable` finding that names no line and no index is about a whole input (a file, or a member of an
    archive) that could not be read through, so that its records were not all checked: those inputs are also
    counted apart, whatever the listing cap, because they make the check incomplete.
    """

    def __init__(self, max_findings: int):
        if max_findings < 0:
            raise ValueError(f"max_findings must be >= 0, got {max_findings}")
        self.max_findings = max_findings
        self.counts: Counter[str] = Counter()
        self.listed: dict[str, list[Finding]] = {c: [] for c in CATEGORIES}
        self.unreadable_inputs: list[str] = []
        self.unreadable_input_count = 0

    def add(self, category: str, ref: "RecordRef | RecordId", detail: str, field: str | None = None) -> None:
        self.counts[category] += 1
        if category == UNREADABLE and ref.line is None and ref.index is None:
            self.unreadable_input_count += 1
            if len(self.unreadable_inputs) < MAX_UNREADABLE_INPUTS_LISTED:
                self.unreadable_inputs.append(ref.file + (f":{ref.member}" if ref.member is not None else ""))
        kept = self.listed.setdefault(category, [])
        if len(kept) < self.max_findings:
            record = ref.id() if isinstance(ref, RecordRef) else ref
            kept.append(Finding(category, record, detail, field))

    def add_uncounted_listing(self, category: str, count: int) -> None:
        """Count findings that were tallied elsewhere and cannot be listed (beyond a sample cap)."""
        self.counts[category] += count

    def findings(self) -> list[Finding]:
        return [f for c in CATEGORIES for f in self.listed.get(c, [])]


class TokenLengths:
    """Token counts per record as an exact histogram (memory grows with the longest record, not the count)."""

    def __init__(self):
        self._counts = np.zeros(0, dtype=np.int64)

    def add(self, lengths: np.ndarray) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            return
        binned = np.bincount(lengths)
        if len(binned) > len(self._counts):
            self._counts = np.concatenate([self._counts, np.zeros(len(binned) - len(self._counts), np.int64)])
        self._counts[: len(binned)] += binned

    @property
    def records(self) -> int:
        return int(self._counts.sum())

    def quantile(self, q: float) -> int | None:
        """Nearest-rank quantile: the smallest length L with at least q of the records at or below L."""
        total = self.records
        if total == 0:
            return None
        rank = max(1, int(np.ceil(q * total)))
        return int(np.searchsorted(np.cumsum(self._counts), rank))

    def summary(self) -> dict:
        return {"records": self.records, "p50": self.quantile(0.5), "p99": self.quantile(0.99),
                "max": (int(np.flatnonzero(self._counts)[-1]) if self.records else None)}


@dataclass
class _Variant:
    count: int = 0
    samples: list = field(default_factory=list)  # RecordId or lazy RecordRef, at most SAMPLES_PER_SIGNATURE


class FieldTracker:
    """Tallies, per field, how many records hold each (kind, shape), and which keys each record has.

    `kind` is a type name ("number", "string", "list[number]", "array[float32]", "image[RGB]", ...); `shape` is a
    tuple for sequences and arrays, None for scalars. Empty values are not tallied (they are `empty` findings).
    """

    def __init__(self, samples_per_signature: int = SAMPLES_PER_SIGNATURE):
        self.samples_per_signature = samples_per_signature
        self._fields: dict[str, dict[tuple, _Variant]] = {}
        self._field_samples: Counter[str] = Counter()
        self._keysets: dict[frozenset, _Variant] = {}
        self._keyset_samples = 0

    def _take(self, variant: _Variant, budget_key: str | None, refs: "Callable[[int], Iterable[RecordRef]]",
              count: int) -> None:
        room = self.samples_per_signature - len(variant.samples)
        if budget_key is None:
            room = min(room, SAMPLES_PER_FIELD - self._keyset_samples)
        else:
            room = min(room, SAMPLES_PER_FIELD - self._field_samples[budget_key])
        take = min(room, count)
        if take <= 0:
            return
        # Keep a reference unresolved only when that is cheap; others are resolved now so that the record they
        # were computed from is not kept alive.
        taken = [r if r.lazy else r.id() for r in refs(take)]
        variant.samples.extend(taken)
        if budget_key is None:
            self._keyset_samples += len(taken)
        else:
            self._field_samples[budget_key] += len(taken)

    def add(self, name: str, kind: str, shape: tuple | None, ref: RecordRef) -> None:
        self.add_many(name, kind, shape, 1, lambda k: [ref])

    def add_many(self, name: str, kind: str, shape: tuple | None, count: int,
                 refs: "Callable[[int], Iterable[RecordRef]]") -> None:
        """`count` records whose field `name` has this kind and shape; `refs(k)` yields the first k of them."""
        variants = self._fields.get(name)
        if variants is None:
            if len(self._fields) >= MAX_FIELDS:
                return
            variants = self._fields[name] = {}
        if (kind, shape) not in variants and len(variants) >= MAX_VARIANTS_PER_FIELD:
            shape = None
        variant = variants.setdefault((kind, shape), _Variant())
        variant.count += count
        self._take(variant, name, refs, count)

    def add_keys(self, keys: Iterable[str], count: int, refs: "Callable[[int], Iterable[RecordRef]]") -> None:
        keys = frozenset(keys)
        if keys not in self._keysets and len(self._keysets) >= MAX_KEYSETS:
            return
        variant = self._keysets.setdefault(keys, _Variant())
        variant.count += count
        self._take(variant, None, refs, count)

    def report(self, sink: FindingSink) -> None:
        """Add an `inconsistent` finding for every record whose field differs from the field's majority."""
        for name, variants in self._fields.items():
            self._report_field(name, variants, sink)
        self._report_missing_keys(sink)

    def _report_field(self, name: str, variants: dict[tuple, _Variant], sink: FindingSink) -> None:
        kinds: Counter[str] = Counter()
        for (kind, _shape), v in variants.items():
            kinds[kind] += v.count
        total = sum(kinds.values())
        major_kind, major_count = kinds.most_common(1)[0]
        if major_count * 2 > total:
            # ROOT_FIELD holds the kind of records that are not mappings (a JSON line that is a list or a number)
            subject = "the record" if name == ROOT_FIELD else f"field {name!r}"
            for (kind, shape), v in variants.items():
                if kind != major_kind:
                    detail = (f"{subject} is {_describe(kind, shape)} here, {major_kind} in "
                              f"{major_count} of {total} records")
                    _emit(sink, v, name, detail)
        shapes: Counter = Counter()
        for (kind, shape), v in variants.items():
            if kind == major_kind and shape is not None:
                shapes[shape] += v.count
        if not shapes:
            return
        shaped = sum(shapes.values())
        major_shape, shape_count = shapes.most_common(1)[0]
        if shape_count < UNIFORM_SHARE * shaped or shape_count == shaped:
            return
        for (kind, shape), v in variants.items():
            if kind == major_kind and shape is not None and shape != major_shape:
                detail = (f"field {name!r} has shape {list(shape)} here, {list(major_shape)} in {shape_count} of "
                          f"{shaped} records")
                _emit(sink, v, name, detail)

    def _report_missing_keys(self, sink: FindingSink) -> None:
        total = sum(v.count for v in self._keysets.values())
        if total == 0:
            return
        present: Counter[str] = Counter()
        for keys, v in self._keysets.items():
            for key in keys:
                present[key] += v.count
        usual = {k for k, n in present.items() if n >= UNIFORM_SHARE * total}
        for keys, v in self._keysets.items():
            missing = sorted(usual - keys)
            if missing:
                shown = ", ".join(repr(k) for k in missing[:8]) + (" ..." if len(missing) > 8 else "")
                detail = f"missing field(s) {shown} present in at least {UNIFORM_SHARE:.0%} of records"
                _emit(sink, v, missing[0], detail)


def _describe(kind: str, shape: tuple | None) -> str:
    return kind if shape is None else f"{kind} of shape {list(shape)}"


def _emit(sink: FindingSink, variant: _Variant, name: str, detail: str) -> None:
    for record in variant.samples:
        sink.add(INCONSISTENT, record, detail, name)
    sink.add_uncounted_listing(INCONSISTENT, variant.count - len(variant.samples))


@dataclass
class Boundary:
    """The most extreme record seen on one axis (longest in tokens, largest finite magnitude)."""

    value: float
    record: RecordId
    field: str | None = None

    def to_dict(self) -> dict:
        return {"value": self.value, "record": str(self.record), **self.record.to_dict(), "field": self.field}


@dataclass
class DataReport:
    """The result of a dataset check. `counts` are exact; `findings` lists up to max_findings per category."""

    findings: list[Finding]
    counts: dict[str, int]
    records: int
    files: int
    bytes: int
    tokens: dict
    longest: Boundary | None = None
    largest_magnitude: Boundary | None = None
    max_tokens: int | None = None
    tokenizer: str = "whitespace"
    fields: TrainingFields = field(default_factory=TrainingFields)
    listed_per_category: int = 0
    skipped: list[str] = field(default_factory=list)  # files of unknown formats found in folders (not checked)
    skipped_count: int = 0  # all of them; `skipped` lists the first ones
    # Inputs (files, or "file:member" for archives) that could not be read through: their records were not all
    # checked. `unreadable_inputs` lists the first ones; each also has an `unreadable` finding.
    unreadable_inputs: list[str] = field(default_factory=list)
    unreadable_input_count: int = 0

    def failing(self, fail_on: Iterable[str] = DEFAULT_FAIL_ON) -> dict[str, int]:
        """Counts of the categories in `fail_on` that have findings."""
        return {c: self.counts.get(c, 0) for c in fail_on if self.counts.get(c, 0)}

    @property
    def complete(self) -> bool:
        """True when every input was read through (each record was checked)."""
        return self.unreadable_input_count == 0

    def status(self, fail_on: Iterable[str] = DEFAULT_FAIL_ON) -> str:
        """"unreadable" when an input could not be read through (whatever `fail_on` says: its records are
        unknown), else "findings" when a category in `fail_on` has findings, else "clean"."""
        if not self.complete:
            return "unreadable"
        return "findings" if self.failing(fail_on) else "clean"

    def exit_code(self, fail_on: Iterable[str] = DEFAULT_FAIL_ON) -> int:
        """The `nanscan data` exit status: 0 clean, 1 findings, 3 an input could not be read (2 is for usage)."""
        return EXIT_CODES[self.status(fail_on)]

    @property
    def ok(self) -> bool:
        return self.status() == "clean"

    def to_dict(self, fail_on: Iterable[str] = DEFAULT_FAIL_ON) -> dict:
        fail_on = list(fail_on)
        return {
            "ok": self.status(fail_on) == "clean", "status": self.status(fail_on),
            "fail_on": fail_on, "failing": self.failing(fail_on),
            "unreadable_inputs": self.unreadable_inputs, "unreadable_input_count": self.unreadable_input_count,
            "counts": {c: self.counts.get(c, 0) for c in CATEGORIES},
            "records": self.records, "files": self.files, "bytes": self.bytes,
            "tokens": {**self.tokens, "tokenizer": self.tokenizer, "max_tokens": self.max_tokens},
            "fields": self.fields.to_dict(),
            "boundary": {
                "longest": self.longest.to_dict() if self.longest else None,
                "largest_magnitude": self.largest_magnitude.to_dict() if self.largest_magnitude else None,
            },
            "listed_per_category": self.listed_per_category,
            "skipped": self.skipped, "skipped_count": self.skipped_count,
            "findings": [f.to_dict() for f in self.findings],
        }
