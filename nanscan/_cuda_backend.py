"""The CUDA backend: the multi-tensor kernel of csrc/cuda through nanscan._C, with a synchronous `scan_records`
for `scan()` and `scan_async`, which only enqueues work on the stream and never waits for the GPU.

There is deliberately no numba-cuda fallback: on a GPU without this extension, auto selection uses the reference
backend, which runs on any device (slower, but the same answers), and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from nanscan import _layout as L
from nanscan.backends import _native_module
from nanscan.inputs import ScanInput

# One row of the kernel's chunk table (csrc/cuda/scan_cuda.h, struct ChunkMeta); checked against
# _C.cuda_layout() before first use.
CHUNK_META_DTYPE = np.dtype([("data", "<u8"), ("begin", "<i8"), ("end", "<i8"), ("tensor", "<i4"), ("dtype", "<i4")])

# Bytes per chunk: a few thousand chunks per GB, so blocks finish together and the per-chunk merge stays cheap.
DEFAULT_CHUNK_BYTES = 1 << 20

_ELEMENT_SIZES = np.array([2, 2, 4, 8], dtype=np.int64)  # indexed by dtype code (nanscan._layout)
assert [_ELEMENT_SIZES[c] for c in (L.FLOAT16, L.BFLOAT16, L.FLOAT32, L.FLOAT64)] == [2, 2, 4, 8]


def build_chunk_table(ptrs: np.ndarray, numels: np.ndarray, codes: np.ndarray, *, chunk_bytes: int,
                      max_chunk_elems: int) -> np.ndarray:
    """The chunk table for tensors given as element-aligned addresses, element counts and dtype codes.

    Each tensor is cut into chunks of `chunk_bytes` (at most `max_chunk_elems` elements); empty tensors get none.
    """
    ptrs = np.asarray(ptrs, dtype=np.uint64)
    numels = np.asarray(numels, dtype=np.int64)
    codes = np.asarray(codes, dtype=np.int32)
    if not (len(ptrs) == len(numels) == len(codes)):
        raise ValueError("build_chunk_table: ptrs, numels and codes must have the same length")
    if chunk_bytes < 16 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of 16 (one vector load)")
    if len(codes) and (codes.min() < 0 or codes.max() >= len(_ELEMENT_SIZES)):
        raise ValueError(f"build_chunk_table: unknown dtype code in {sorted(set(codes.tolist()))}")
    sizes = _ELEMENT_SIZES[codes]
    misaligned = np.flatnonzero((ptrs % sizes.astype(np.uint64)) != 0)
    if len(misaligned):
        i = int(misaligned[0])
        raise ValueError(f"tensor {i} starts at address {int(ptrs[i]):#x}, not a multiple of its element size "
                         f"{int(sizes[i])}; the CUDA scan needs element-aligned tensors (pass a .contiguous() copy)")
    per_chunk = np.minimum(chunk_bytes // sizes, max_chunk_elems)
    counts = -(-numels // per_chunk)
    tensor = np.repeat(np.arange(len(numels), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    begin = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)) * per_chunk[tensor]
    table = np.empty(len(tensor), dtype=CHUNK_META_DTYPE)
    table["data"] = ptrs[tensor]
    table["begin"] = begin
    table["end"] = np.minimum(begin + per_chunk[tensor], numels[tensor])
    table["tensor"] = tensor
    table["dtype"] = codes[tensor]
    return table


def _table_for(inputs: Sequence[ScanInput], chunk_bytes: int, max_chunk_elems: int) -> np.ndarray:
    n = len(inputs)
    ptrs = np.fromiter((item.flat.data_ptr() for item in inputs), dtype=np.uint64, count=n)
    numels = np.fromiter((item.numel for item in inputs), dtype=np.int64, count=n)
    codes = np.fromiter((item.scanned_code for item in inputs), dtype=np.int32, count=n)
    return build_chunk_table(ptrs, numels, codes, chunk_bytes=chunk_bytes, max_chunk_elems=max_chunk_elems)


def _check_layout(C) -> dict:
    layout = C.cuda_layout()
    offsets = {name: CHUNK_META_DTYPE.fields[name][1] for name in CHUNK_META_DTYPE.names}
    if layout["chunk_meta_itemsize"] != CHUNK_META_DTYPE.itemsize or layout["chunk_meta_offsets"] != offsets:
        raise RuntimeError(f"nanscan._C's ChunkMeta layout {layout['chunk_meta_offsets']} does not match "
                           f"nanscan/_cuda_backend.py's {offsets}; reinstall nanscan so both come from one version")
    return layout


def scan_records_on_host(inputs: Sequence[ScanInput], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> np.ndarray:
    """Records for CPU tensors computed by the CUDA kernel's own per-thread code run on the CPU
    (csrc/cuda/scan_cuda.h, scan_on_host), with the chunk table the CUDA backend would build. For tests on
    machines without a GPU; needs an extension built with nvcc."""
    C = _native_module()
    if not hasattr(C, "scan_cuda_on_host"):
        raise RuntimeError("nanscan._C was built without its CUDA part (nvcc was not found at build time)")
    layout = _check_layout(C)
    if any(item.device.type != "cpu" for item in inputs):
        raise ValueError("scan_records_on_host reads tensors through host addresses: pass CPU tensors")
    table = _table_for(inputs, chunk_bytes, layout["max_chunk_elems"])
    records = np.empty((len(inputs), L.RECORD_WIDTH), dtype=np.int64)
    C.scan_cuda_on_host(table.view(np.uint8), records)
    return records


@dataclass
class AsyncScan:
    """A scan enqueued on a CUDA stream. Nothing here has waited for the GPU.

    `found_inf` is a float32 device tensor of shape (), 1.0 when any scanned value is NaN or infinite, else 0.0:
    pass it to a fused optimizer (`optimizer.found_inf = scan.found_inf` before `optimizer.step()` for torch's
    fused Adam/AdamW/SGD) to skip the update without reading it on the host. `records()` waits for the scan and
    returns the (n, record width) int64 records (NOTE: [stats record]).
    """

    found_inf: torch.Tensor
    device_records: torch.Tensor
    num_tensors: int
    _host_records: torch.Tensor = field(repr=False)
    _done: torch.cuda.Event = field(repr=False)
    _keep_alive: tuple = field(default=(), repr=False)  # inputs and chunk table, until the kernel has read them

    def ready(self) -> bool:
        """True once the scan and the copy of its records to the host have finished (never blocks)."""
        return self._done.query()

    def records(self) -> np.ndarray:
        """The records in host memory, waiting for the GPU if it has not finished yet."""
        self._done.synchronize()
        self._keep_alive = ()
        return self._host_records.numpy()


class CudaBackend:
    """The CUDA kernel (csrc/cuda/scan_cuda.cu): one launch for all tensors and dtypes of a device."""

    name = "cuda"

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        C = _native_module()
        if not hasattr(C, "scan_cuda"):
            raise RuntimeError(
                "nanscan._C was built without its CUDA part (no nvcc at build time); rebuild where the CUDA toolkit "
                "is installed: NANSCAN_CUDA=1 pip install --no-build-isolation -e .")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda}): no usable GPU or driver here; scan CPU tensors with the cpu backend")
        layout = _check_layout(C)
        try:
            C.cuda_probe(torch.cuda.current_device())
        except RuntimeError as exc:
            raise RuntimeError(
                f"the CUDA kernels of nanscan._C (built with CUDA runtime {layout['runtime_version']}, archs "
                f"{C.build_info().get('cuda_arch')}) cannot run on {torch.cuda.get_device_name()}: {exc}. Rebuild "
                "with a toolkit the driver supports, and NANSCAN_CUDA_ARCH set to this GPU's compute capability"
            ) from exc
        self._C = C
        self.chunk_bytes = chunk_bytes
        self._max_chunk_elems = int(layout["max_chunk_elems"])
        self._probed = {torch.cuda.current_device()}
        # The last chunk table per (device, stream), in host and device memory: a training loop scans the same
        # tensors each step, so the table is usually reused without another copy. Per stream, because the copy
        # that filled it is ordered on its stream only.
        self._tables: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor]] = {}

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray:
        return self.scan_async(inputs).records()

    def scan_async(self, inputs: Sequence[ScanInput], stream: torch.cuda.Stream | None = None) -> AsyncScan:
        """Enqueue a scan of `inputs` (all on one CUDA device) on `stream` (default: the current stream).

        The kernel reads the tensors when the stream reaches it, so they must not be modified by other streams
        until then (the usual torch stream rule); the returned AsyncScan keeps them alive.
        """
        devices = {item.device for item in inputs}
        if len(devices) > 1:
            raise ValueError(f"scan_async scans one device at a time; got tensors on {sorted(map(str, devices))}")
        device = devices.pop() if devices else (stream.device if stream is not None
                                                else torch.device("cuda", torch.cuda.current_device()))
        if device.type != "cuda":
            raise ValueError(f"the cuda backend scans CUDA tensors; got tensors on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._probed:
            self._C.cuda_probe(index)
            self._probed.add(index)
        n = len(inputs)
        with torch.cuda.device(index):
            stream = stream if stream is not None else torch.cuda.current_stream(index)
            with torch.cuda.stream(stream):
                table, device_table = self._device_table(inputs, index, stream)
                records = torch.empty((n, L.RECORD_WIDTH), dtype=torch.int64, device=device)
                found_inf = torch.empty((), dtype=torch.float32, device=device)
                self._C.scan_cuda(device_table.data_ptr() if len(table) else 0, len(table), records.data_ptr(), n,
                                  found_inf.data_ptr(), stream.cuda_stream, index)
                host_records = torch.empty((n, L.RECORD_WIDTH), dtype=torch.int64, pin_memory=True)
                host_records.copy_(records, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        return AsyncScan(found_inf=found_inf, device_records=records, num_tensors=n, _host_records=host_records,
                         _done=done, _keep_alive=(device_table, [item.flat for item in inputs]))

    def _device_table(self, inputs: Sequence[ScanInput], index: int,
                      stream: torch.cuda.Stream) -> tuple[np.ndarray, torch.Tensor]:
        """The chunk table on the device, copied from pinned memory without blocking, or the cached one."""
        table = _table_for(inputs, self.chunk_bytes, self._max_chunk_elems)
        key = (index, stream.cuda_stream)
        cached = self._tables.get(key)
        if cached is not None and cached[0].tobytes() == table.tobytes():
            return cached
        device_table = torch.empty(table.nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        if len(table):
            pinned = torch.from_numpy(table.view(np.uint8)).pin_memory()
            device_table.copy_(pinned, non_blocking=True)
        self._tables[key] = (table, device_table)
        return table, device_table
