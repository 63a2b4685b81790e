"""Typed stub of nanscan._C, the compiled extension registered in csrc/bindings.cpp: the CPU scan, classify.h per
element, the per-step plan checks (csrc/plan), and the CUDA entry points, which exist only in a build with CUDA."""

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

def scan_cpu(
    ptrs: npt.ArrayLike,
    numels: npt.ArrayLike,
    dtypes: npt.ArrayLike,
    records: npt.NDArray[np.int64],
    chunk_elems: int,
    num_threads: int = 0,
) -> int:
    """Scan raw pointers into a C-contiguous (n, record width) int64 records array; returns how many hold NaN/inf."""

def read_bandwidth_probe(
    ptrs: npt.ArrayLike, numels: npt.ArrayLike, dtypes: npt.ArrayLike, chunk_elems: int, num_threads: int = 0
) -> int:
    """Read the tensors as scan_cpu does, doing nothing else (a speed ceiling); returns the XOR of the bytes read."""

def classify_bits(bits: npt.ArrayLike, dtype: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Classify bit patterns with classify.h: returns (value classes, exponent bins or -1)."""

def compact_records(
    records: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int16], npt.NDArray[np.unsignedinteger[Any]]]:
    """A step's records compacted (NOTE: [compact records]): scalars, ranges, counts in the narrowest unsigned type."""

def compact_fixed(
    records: int, rows: int, scalars: int, ranges: int, counts: int, capacity: int, status: int
) -> None:
    """compact_cuda's contract over host addresses: uint32 counts into `capacity` slots when they fit."""

def build_info() -> dict[str, Any]:
    """How the extension was built: OpenMP, CUDA, SIMD (cpu_simd, and cpu_float8: how float8 is read), and the record
    layout and dtype codes it uses."""

def batch_leaves(batch: object, loss: object, plan: tuple[Any, ...]) -> tuple[list[Any], list[int]] | None:
    """The per-step check of nanscan.engine.plans.BatchPlan: (scanned leaves and loss, data pointers), or None if
    changed."""

def tensor_stamps(tensors: list[Any], tensor_access: object) -> npt.NDArray[np.int64] | None:
    """Each tensor's (version counter, data pointer, scalar type) as an (n, 3) int64 array, or None."""

class ScanTable:
    """A step's input table without pointers (NOTE: [scan table] in plan_check.cpp): element counts and format
    codes, checked once."""

    def __init__(self, numels: npt.ArrayLike, dtypes: npt.ArrayLike) -> None: ...
    def __len__(self) -> int: ...

class PlanCheck:
    """The per-step check of nanscan.engine.plans.ModelScanPlan (NOTE: [plan check]), built at its rebuild."""

    def __init__(
        self,
        child_dicts: list[dict[str, Any]],
        children: list[Any],
        param_dicts: list[dict[str, Any]],
        raw_params: list[Any],
        state_values: list[Any],
        params: list[Any],
        grad_absent: list[bool],
        state_tensors: list[Any],
        stable_ptrs: npt.ArrayLike,
        stable_dtypes: list[Any],
        stable_nbytes: npt.ArrayLike,
        data_ptr: Callable[[Any], int],
        is_contiguous: Callable[[Any], bool],
        tensor_access: object | None = None,
    ) -> None:
        """Hold what the rebuild found; tensor_access is nanscan._torch_access's capsule, or None for Python calls."""

    def check(
        self, optimizer_state: dict[Any, dict[str, Any]] | None, extra_ptrs: list[int]
    ) -> tuple[npt.NDArray[np.int64], list[Any]] | None:
        """None if anything changed since the rebuild, else (pointers, gradients)."""

    def check_and_scan(
        self,
        optimizer_state: dict[Any, dict[str, Any]] | None,
        extra_ptrs: list[int],
        numels: npt.ArrayLike,
        dtypes: npt.ArrayLike,
        records: npt.NDArray[np.int64],
        chunk_elems: int,
        num_threads: int = 0,
        carried: tuple | list[tuple] | None = None,
    ) -> int | None:
        """check() and, when nothing changed, the scan into records: None, or how many tensors hold NaN/inf.
        carried: (stable indices, stamps, records) standing in for tensors whose stamps did not move, or a list of
        such parts (a later one's row wins); a part (stable indices, stamps, records, True) is standing: its
        arrays are refreshed in place with the stamps and records of what this call scanned (NOTE: [frozen
        records] in nanscan/engine/plans.py)."""

    def check_scan_summary(
        self,
        optimizer_state: dict[Any, dict[str, Any]] | None,
        extra_ptrs: list[int],
        table: ScanTable,
        chunk_elems: int,
        num_threads: int = 0,
        carried: tuple | list[tuple] | None = None,
        loss_row: int = -1,
    ) -> tuple[npt.NDArray[np.int64], int, npt.NDArray[np.int64], npt.NDArray[np.int16], npt.NDArray[Any], float,
               float | None, float | None] | None:
        """check_and_scan() over the table's inputs, into records it makes, that also returns them and the step's
        summary (NOTE: [step summary] in plan_check.cpp): None, or (the records, tensors holding NaN/inf, compact
        scalars, ranges and counts as compact_records gives them, the gradient rows' sum of squares added in row
        order, the sum of squares of the extra input `loss_row` and its value when it has one element of
        float32/float64/bfloat16/float16; None where there is none)."""

# Present only when the extension was built with CUDA (build_info()["cuda"] is True, NANSCAN_WITH_CUDA).

def scan_cuda(
    chunks: int,
    num_chunks: int,
    block_begin: int,
    num_blocks: int,
    records: int,
    num_tensors: int,
    found_inf: int,
    stream: int,
    device: int,
) -> None:
    """CUDA builds only: enqueue the scan on `stream` (device pointers and the stream handle as ints)."""

def compact_cuda(
    records: int,
    rows: int,
    scalars: int,
    ranges: int,
    counts: int,
    capacity: int,
    workspace: int,
    status: int,
    stream: int,
    device: int,
) -> None:
    """CUDA builds only: enqueue the compaction of device records on `stream` (NOTE: [compact records])."""

def cuda_grid(device: int) -> int:
    """CUDA builds only: how many scan blocks fit on CUDA device `device` at once."""

def cuda_probe(device: int) -> None:
    """CUDA builds only: raise RuntimeError when this build's kernels cannot run on CUDA device `device`."""

def cuda_layout() -> dict[str, Any]:
    """CUDA builds only: kernel constants and the ChunkMeta layout of the CUDA scan."""

def scan_cuda_on_host(
    chunk_table: npt.NDArray[np.uint8], block_begin: npt.ArrayLike, records: npt.NDArray[np.int64]
) -> None:
    """CUDA builds only: the CUDA kernel's per-thread code on the CPU over a chunk table of host addresses."""
