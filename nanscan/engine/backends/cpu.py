"""The native CPU backend: the C++/OpenMP kernel (csrc/cpu/scan_cpu.cpp) through nanscan._C."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine._native import native_module
from nanscan.engine.compact import CompactRecords
from nanscan.engine.inputs import ScanInput, as_scan_inputs
from nanscan.engine.pending import StepSummary


class CpuBackend:
    """The C++/OpenMP kernel (csrc/cpu/scan_cpu.cpp) through the pybind11 extension nanscan._C."""

    name = "cpu"

    def __init__(self, *, chunk_elems: int = L.DEFAULT_CHUNK_ELEMS, num_threads: int = 0):
        self._C = native_module()
        self.chunk_elems = chunk_elems
        self.num_threads = num_threads

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray:
        return self.scan_with_verdict(inputs)[0]

    def scan_with_verdict(self, inputs: Sequence[ScanInput]) -> tuple[np.ndarray, bool]:
        """The records and whether any tensor holds a NaN or an infinity, which the kernel's wrapper counts while
        the records are still in cache (launch asks for it, so a Monitor step needs no pass over them)."""
        ptrs, numels, codes = as_scan_inputs(inputs).table()  # NOTE: [input table]
        records = np.empty((len(numels), L.RECORD_WIDTH), dtype=np.int64)  # scan_cpu sets every slot
        nonfinite = self._C.scan_cpu(ptrs, numels, codes, records, self.chunk_elems, self.num_threads)
        return records, nonfinite > 0

    def scan_planned(self, check, optimizer_state, extra_ptrs: list[int], table, carried: tuple | None = None,
                     loss_row: int = -1) -> tuple | None:
        """A model scan plan's per-step check (nanscan._C.PlanCheck) and, when it passes, the scan of the inputs it
        found, in one call (NOTE: [wake overlap] in csrc/cpu/scan_cpu.cpp), over the step's nanscan._C.ScanTable
        (NOTE: [scan table] in csrc/plan/plan_check.cpp): None when the plan changed (nothing was scanned), else
        (records, whether any tensor holds a NaN or an infinity, the step's StepSummary with the loss at extra input
        `loss_row`, -1 for none: NOTE: [step summary] in csrc/plan/plan_check.cpp).
        `carried`: records that stand in for unchanged tensors (nanscan.runtime.update NOTE: [carried records])."""
        done = check.check_scan_summary(optimizer_state, extra_ptrs, table, self.chunk_elems, self.num_threads,
                                        carried, loss_row)
        if done is None:
            return None
        records, nonfinite, scalars, ranges, counts, grad_sumsq, loss_sumsq, loss_value = done
        return records, nonfinite > 0, StepSummary(CompactRecords(scalars, ranges, counts), grad_sumsq, loss_sumsq,
                                                   loss_value)
