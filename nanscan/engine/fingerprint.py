"""Two state dicts compared bit for bit through one scan each (compare_state_dicts): a checkpoint written and read
back, a resumed run's first step against the original, two replicas. Each tensor is told by its scan fingerprint
(NOTE: [scan fingerprint] in csrc/include/nanscan/stats_record.h), so nothing is copied between devices and no
tensor is compared element by element: a tensor on a GPU and its copy on the CPU are each scanned where they are.
compare_scans does the same for two scans already made: a recorded step and its rerun (NOTE: [bit-exact rerun]).

NOTE: [bit-exact rerun]
A bundle keeps its failing step's records, fingerprints included (the history). A rerun of that step (`nanscan
replay`, the Monitor's in-process rerun) scans the same names and compares them: "reproduced bit for bit", or the
first tensor whose bits differ, finite in both or not. Only what the rerun recomputes from the same inputs is
comparable: the inputs, the starting weights and optimizer state, and the gradients of a step checked once after
its backward; not a micro-batch's partial sum, nor an accumulated step rerun one micro-batch at a time, nor
gradients the record holds scaled by a GradScaler. Replay runs deterministic algorithms; where its reruns agree
with each other and with one more rerun without them, the kernels' nondeterminism does not explain a difference
from the record, and what remains is code outside the rerun that wrote into those tensors, or the hardware: the only
way nanscan names the hardware, and it says what it measured (nanscan.replay.reproduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import torch

from nanscan.engine.stats import ScanReport, TensorStats
from nanscan.scan import scan

# What a difference can be, in the order it is looked for.
MISSING_IN_A, MISSING_IN_B, KIND, DTYPE, SHAPE, BITS, VALUE = (
    "missing in a", "missing in b", "kind", "dtype", "shape", "bits", "value")


@dataclass(frozen=True)
class Difference:
    """One entry that differs between the two state dicts.

    `what`: MISSING_IN_A / MISSING_IN_B (the key is on one side only), KIND (a tensor on one side, something else on
    the other), DTYPE, SHAPE, BITS (same dtype and shape, other bits: the fingerprints differ), VALUE (a non-tensor
    entry, e.g. an optimizer's step count or learning rate, compared with ==). For BITS, `finite_in_both` says
    whether both tensors hold finite values only (a finite wrong value, which no NaN check sees) and `a` and `b`
    are the two tensors' TensorStats (all three None for integer and bool tensors, compared with torch.equal)."""

    name: str
    what: str
    detail: str
    finite_in_both: bool | None = None
    a: TensorStats | None = None
    b: TensorStats | None = None

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"

    def to_dict(self) -> dict:
        """As a finding records it (replay's and the in-process rerun's bit-exact comparison)."""
        return {"name": self.name, "what": self.what, "detail": self.detail, "finite_in_both": self.finite_in_both}


@dataclass(frozen=True)
class StateDictComparison:
    """What compare_state_dicts found. `differences` in the dicts' order (a's keys, then those only in b);
    `first_difference` the first of them, or None when the dicts are equal; `compared` the entries present on both
    sides."""

    differences: list[Difference] = field(default_factory=list)
    compared: int = 0

    @property
    def equal(self) -> bool:
        return not self.differences

    def __bool__(self) -> bool:
        return self.equal

    @property
    def first_difference(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    @property
    def missing_in_a(self) -> list[str]:
        return [d.name for d in self.differences if d.what == MISSING_IN_A]

    @property
    def missing_in_b(self) -> list[str]:
        return [d.name for d in self.differences if d.what == MISSING_IN_B]

    def __str__(self) -> str:
        if self.equal:
            return f"equal: {self.compared} entries, bit for bit"
        first = self.differences[0]
        more = len(self.differences) - 1
        return (f"differ: {first}" + (f" (and {more} more)" if more else "")
                + f"; {self.compared} entries on both sides")


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for every tensor and plain value of a state dict, nested dicts and lists included (an
    optimizer's state_dict: state.<i>.<key>, param_groups.<j>.<key>)."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def _scanned(tensors: dict[str, torch.Tensor], backend: Any) -> ScanReport:
    """One scan of the floating tensors, each read in row-major order: a tensor whose strides are permuted or that
    has gaps is scanned as a contiguous copy, so that the fingerprint (which follows the order the scan reads,
    NOTE: [flat views] in nanscan/engine/inputs.py) does not depend on how either side laid it out."""
    laid_out = {name: t if t.is_contiguous() else t.contiguous() for name, t in tensors.items()}
    return scan(laid_out, backend=backend)


def _same_plain(a: Any, b: Any) -> bool:
    """== for plain values, with NaN equal to NaN (a learning rate stored as nan is the same nan)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - values whose == does not give a truth value are compared by identity
        return a is b


def compare_state_dicts(a: Mapping, b: Mapping, *, backend: Any = None) -> StateDictComparison:
    """Compare two state dicts (a model's or an optimizer's, nested dicts and lists included) bit for bit.

    Every floating tensor is scanned once, each dict in one scan call per device, and compared by its exact
    fingerprint (docs/scan.md): equal tensors always match; one changed element, a single flipped bit included, or
    two unequal elements swapped, never does (the bounds are in the fingerprint's NOTE). Integer and bool tensors are
    compared with torch.equal, other values with ==. Returns a StateDictComparison naming, in the dicts' order, every
    entry that differs: keys missing on either side, a dtype or shape that changed, tensors whose bits differ (and
    whether both hold finite values only), other values that differ. `backend`: as for nanscan.scan.

    A checkpoint written and read back::

        torch.save(model.state_dict(), path)
        result = nanscan.compare_state_dicts(model.state_dict(), torch.load(path))
        assert result.equal, result.first_difference

    The fingerprint is not cryptographic: it finds accidental corruption, not a change made to be missed.
    """
    leaves_a, leaves_b = dict(_leaves(a)), dict(_leaves(b))
    both = [name for name in leaves_a if name in leaves_b]
    float_names = [name for name in both if isinstance(leaves_a[name], torch.Tensor)
                   and isinstance(leaves_b[name], torch.Tensor) and leaves_a[name].dtype == leaves_b[name].dtype
                   and leaves_a[name].shape == leaves_b[name].shape
                   and (leaves_a[name].is_floating_point() or leaves_a[name].is_complex())]
    report_a = _scanned({name: leaves_a[name] for name in float_names}, backend)
    report_b = _scanned({name: leaves_b[name] for name in float_names}, backend)
    fingerprints_a, fingerprints_b = report_a.fingerprints, report_b.fingerprints
    differences = []
    for name, va in leaves_a.items():
        if name not in leaves_b:
            differences.append(Difference(name, MISSING_IN_B, "in a only"))
            continue
        vb = leaves_b[name]
        if isinstance(va, torch.Tensor) != isinstance(vb, torch.Tensor):
            kinds = " vs ".join(type(v).__name__ for v in (va, vb))
            differences.append(Difference(name, KIND, f"a tensor on one side only ({kinds})"))
        elif not isinstance(va, torch.Tensor):
            if not _same_plain(va, vb):
                differences.append(Difference(name, VALUE, f"{va!r} vs {vb!r}"))
        elif va.dtype != vb.dtype:
            differences.append(Difference(name, DTYPE, f"dtype {va.dtype} vs {vb.dtype}"))
        elif va.shape != vb.shape:
            differences.append(Difference(name, SHAPE, f"shape {tuple(va.shape)} vs {tuple(vb.shape)}"))
        elif name in fingerprints_a:
            fa, fb = fingerprints_a[name], fingerprints_b[name]
            if fa != fb:
                sa, sb = report_a[name], report_b[name]
                finite = sa.ok and sb.ok
                differences.append(Difference(
                    name, BITS, f"bits differ (fingerprints {fa:#018x} vs {fb:#018x}; "
                    + ("finite in both" if finite else f"non-finite values: {sa.nonfinite} vs {sb.nonfinite}") + ")",
                    finite_in_both=finite, a=sa, b=sb))
        elif not torch.equal(va.detach().cpu(), vb.detach().cpu()):  # integer and bool tensors: their values
            differences.append(Difference(name, BITS, "values differ"))
    differences += [Difference(name, MISSING_IN_A, "in b only") for name in leaves_b if name not in leaves_a]
    return StateDictComparison(differences, compared=len(both))


def compare_scans(recorded: Iterable[TensorStats], rerun: Iterable[TensorStats], *,
                  kinds: tuple[str, ...] | None = None) -> StateDictComparison:
    """Compare two scans of the same step's tensors by name, bit for bit (a recorded step and its rerun: replay and
    the Monitor's in-process rerun, NOTE: [bit-exact rerun]). `kinds`: the name prefixes compared ("grad:", ...),
    None for every name. A tensor without a fingerprint on either side (a bundle written before fingerprints) is not
    compared; names on one side only are MISSING_IN_A / MISSING_IN_B, in `recorded`'s order then `rerun`'s."""
    def wanted(stats: TensorStats) -> bool:
        return kinds is None or stats.name.startswith(kinds)

    a = {s.name: s for s in recorded if wanted(s)}
    b = {s.name: s for s in rerun if wanted(s)}
    differences, compared = [], 0
    for name, sa in a.items():
        sb = b.get(name)
        if sb is None:
            differences.append(Difference(name, MISSING_IN_B, "in the record only"))
        elif sa.dtype != sb.dtype:
            differences.append(Difference(name, DTYPE, f"dtype {sa.dtype} vs {sb.dtype}"))
        elif sa.numel != sb.numel:
            differences.append(Difference(name, SHAPE, f"{sa.numel} vs {sb.numel} elements"))
        elif sa.fingerprint is not None and sb.fingerprint is not None:
            compared += 1
            if sa.fingerprint != sb.fingerprint:
                finite = sa.ok and sb.ok
                differences.append(Difference(
                    name, BITS, "finite in both" if finite else
                    f"non-finite values: {sa.nonfinite} in the record, {sb.nonfinite} in the rerun",
                    finite_in_both=finite, a=sa, b=sb))
    differences += [Difference(name, MISSING_IN_A, "in the rerun only") for name in b if name not in a]
    return StateDictComparison(differences, compared=compared)


# What a rerun recomputes from the same inputs (NOTE: [bit-exact rerun]); the gradients only with the same loss.
RERUN_KINDS = ("input:", "param:", "optim:")


def compare_rerun(recorded: Iterable[TensorStats], rerun: Iterable[TensorStats], *,
                  gradients: bool = True) -> tuple[StateDictComparison, list[str]]:
    """A recorded step against its rerun (NOTE: [bit-exact rerun]): the inputs, the starting state and, when the
    rerun's loss has the recorded loss's bits (the loss given to check() is the one step_fn returns, not divided by
    an accumulation count), the loss and the gradients. Names scanned on one side only are not
    compared. Returns the comparison and what was left out, and why."""
    recorded, rerun = list(recorded), list(rerun)
    left_out = []
    kinds = RERUN_KINDS
    if gradients:
        same_loss = compare_scans(recorded, rerun, kinds=("loss",))
        if same_loss.compared and same_loss.equal:
            kinds = (*RERUN_KINDS, "loss", "grad:")
        else:
            left_out.append("the loss and the gradients (the loss given to check() is not the loss the rerun "
                            "computed: divided by an accumulation count, or another loss)")
    compared = compare_scans(recorded, rerun, kinds=kinds)
    # a tensor on one side only was not compared (the in-process rerun scans no optimizer state): no difference
    kept = [d for d in compared.differences if d.what not in (MISSING_IN_A, MISSING_IN_B)]
    return StateDictComparison(kept, compared=compared.compared), left_out
