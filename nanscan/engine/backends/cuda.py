"""The CUDA backend: the multi-tensor kernel of csrc/cuda through nanscan._C, with a synchronous `scan_records`
for `scan()` and `scan_async`, which only enqueues work on the stream and never waits for the GPU.

On a GPU without this extension, auto selection falls back to numba-cuda (nanscan/engine/backends/numba_cuda.py) when
numba's CUDA target loads, else to the reference backend (slower, the same answers), and says so once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine._native import native_module
from nanscan.engine.inputs import ScanInput, ScanInputs, as_scan_inputs

# One row of the kernel's chunk table (csrc/cuda/scan_cuda.h, struct ChunkMeta); checked against
# _C.cuda_layout() before first use.
CHUNK_META_DTYPE = np.dtype([("data", "<u8"), ("begin", "<i8"), ("end", "<i8"), ("tensor", "<i4"), ("dtype", "<i4")])

# How the bytes are shared among blocks (NOTE: [cuda scan] in csrc/cuda/multi_tensor.cuh). A piece costs its block
# a fixed merge besides its bytes (estimated at 1-2 us, what one block takes to scan about this many bytes when
# all share HBM; not yet measured), so a block of many small tensors is given fewer bytes; and no block is given
# less than MIN_BLOCK_BYTES, so a small scan does not start hundreds of blocks with almost nothing to do.
PIECE_COST_BYTES = 32 << 10
MIN_BLOCK_BYTES = 256 << 10

_CACHED_TABLES = 8  # work lists kept on each backend's devices (a few KiB each)

_ELEMENT_SIZES = np.array([L.FORMATS[c].bytes for c in range(len(L.FORMATS))], dtype=np.int64)  # by dtype code


def build_chunk_table(ptrs: np.ndarray, numels: np.ndarray, codes: np.ndarray, *, max_blocks: int,
                      max_chunk_elems: int, max_chunk_bytes: int | None = None,
                      piece_cost_bytes: int | None = None,
                      min_block_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's work list for tensors given as element-aligned addresses, element counts and dtype codes.

    The tensors' bytes, laid end to end with `piece_cost_bytes` before each, are cut into up to `max_blocks` equal
    shares, each at least `min_block_bytes`; a piece is the part of one tensor inside one share (cut at a 16-byte
    multiple from the tensor's start, and at most `max_chunk_elems` elements and `max_chunk_bytes` bytes long).
    Returns the pieces (CHUNK_META_DTYPE rows, each block's together, in tensor order) and block_begin (int64,
    blocks + 1 entries): block b scans rows [block_begin[b], block_begin[b + 1]). Empty tensors get no piece.
    piece_cost_bytes and min_block_bytes default to the module's PIECE_COST_BYTES and MIN_BLOCK_BYTES.
    """
    piece_cost_bytes = PIECE_COST_BYTES if piece_cost_bytes is None else piece_cost_bytes
    min_block_bytes = MIN_BLOCK_BYTES if min_block_bytes is None else min_block_bytes
    ptrs = np.asarray(ptrs, dtype=np.uint64)
    numels = np.asarray(numels, dtype=np.int64)
    codes = np.asarray(codes, dtype=np.int32)
    if not (len(ptrs) == len(numels) == len(codes)):
        raise ValueError("build_chunk_table: ptrs, numels and codes must have the same length")
    if max_blocks < 1 or max_chunk_elems < 16 or (max_chunk_bytes is not None and max_chunk_bytes < 16):
        raise ValueError(f"build_chunk_table: max_blocks={max_blocks} must be >= 1, max_chunk_elems="
                         f"{max_chunk_elems} and max_chunk_bytes={max_chunk_bytes} >= 16")
    if len(codes) and (codes.min() < 0 or codes.max() >= len(_ELEMENT_SIZES)):
        raise ValueError(f"build_chunk_table: unknown dtype code in {sorted(set(codes.tolist()))}")
    if (numels < 0).any():
        raise ValueError("build_chunk_table: negative element count")
    sizes = _ELEMENT_SIZES[codes]
    misaligned = np.flatnonzero((ptrs % sizes.astype(np.uint64)) != 0)
    if len(misaligned):
        i = int(misaligned[0])
        raise ValueError(f"tensor {i} starts at address {int(ptrs[i]):#x}, not a multiple of its element size "
                         f"{int(sizes[i])}; the CUDA scan needs element-aligned tensors (pass a .contiguous() copy)")
    nbytes = numels * sizes
    weights = np.where(numels > 0, nbytes + piece_cost_bytes, 0)
    total = int(weights.sum())
    if total == 0:
        return np.empty(0, dtype=CHUNK_META_DTYPE), np.zeros(1, dtype=np.int64)
    blocks = int(min(max_blocks, max(1, -(-total // min_block_bytes))))
    bounds = np.array([b * total // blocks for b in range(blocks + 1)], dtype=np.int64)  # exact integers
    start = np.cumsum(weights) - weights  # each tensor's cost starts here, its bytes piece_cost_bytes later
    # Cuts, as (tensor, element): every tensor's ends, the share boundaries that fall inside its bytes, and the
    # multiples of the longest piece allowed.
    inner = bounds[1:-1]
    owner = np.searchsorted(start, inner, side="right") - 1
    offset = np.clip(inner - start[owner] - piece_cost_bytes, 0, nbytes[owner])
    cut_tensor = [np.arange(len(numels)), np.arange(len(numels)), owner]
    cut_elem = [np.zeros(len(numels), np.int64), numels, offset // 16 * 16 // sizes[owner]]
    longest = np.full(len(numels), max_chunk_elems, dtype=np.int64)
    if max_chunk_bytes is not None:
        longest = np.minimum(longest, max_chunk_bytes // sizes)
    for t in np.flatnonzero(numels > longest):
        steps = np.arange(longest[t], int(numels[t]), longest[t], dtype=np.int64)
        cut_tensor.append(np.full(len(steps), t))
        cut_elem.append(steps)
    tensor = np.concatenate(cut_tensor).astype(np.int64)
    elem = np.concatenate(cut_elem).astype(np.int64)
    order = np.lexsort((elem, tensor))
    tensor, elem = tensor[order], elem[order]
    keep = np.ones(len(tensor), dtype=bool)
    keep[1:] = (tensor[1:] != tensor[:-1]) | (elem[1:] != elem[:-1])
    tensor, elem = tensor[keep], elem[keep]
    piece = np.flatnonzero((tensor[:-1] == tensor[1:]) & (elem[1:] > elem[:-1]))
    piece_tensor, begin, end = tensor[piece], elem[piece], elem[piece + 1]
    # A piece belongs to the share that holds its middle (its ends were rounded to 16-byte multiples, so they may
    # lie a few bytes before the share boundary); pieces are in tensor order, so blocks come out in order.
    first = start[piece_tensor] + np.where(begin > 0, piece_cost_bytes + begin * sizes[piece_tensor], 0)
    middle = (first + start[piece_tensor] + piece_cost_bytes + end * sizes[piece_tensor]) // 2
    block = np.clip(np.searchsorted(bounds, middle, side="right") - 1, 0, blocks - 1)
    table = np.empty(len(piece), dtype=CHUNK_META_DTYPE)
    table["data"] = ptrs[piece_tensor]
    table["begin"] = begin
    table["end"] = end
    table["tensor"] = piece_tensor
    table["dtype"] = codes[piece_tensor]
    block_begin = np.searchsorted(block, np.arange(blocks + 1), side="left").astype(np.int64)
    return table, block_begin


def _describe(inputs: ScanInputs) -> np.ndarray:
    """(address, element count, dtype code) per input: all that the work list depends on (NOTE: [input table])."""
    ptrs, numels, codes = inputs.table()
    return np.stack([ptrs, numels, codes.astype(np.int64)])


def _table_for(described: np.ndarray, max_blocks: int, max_chunk_elems: int,
               **options) -> tuple[np.ndarray, np.ndarray]:
    return build_chunk_table(described[0].view(np.uint64), described[1], described[2].astype(np.int32),
                             max_blocks=max_blocks, max_chunk_elems=max_chunk_elems, **options)


def _check_layout(C) -> dict:
    layout = C.cuda_layout()
    offsets = {name: CHUNK_META_DTYPE.fields[name][1] for name in CHUNK_META_DTYPE.names}
    if layout["chunk_meta_itemsize"] != CHUNK_META_DTYPE.itemsize or layout["chunk_meta_offsets"] != offsets:
        raise RuntimeError(f"nanscan._C's ChunkMeta layout {layout['chunk_meta_offsets']} does not match "
                           f"nanscan/engine/backends/cuda.py's {offsets}; "
                           "reinstall nanscan so both come from one version")
    return layout


def scan_records_on_host(inputs: Sequence[ScanInput], *, max_blocks: int = 8,
                         min_block_bytes: int | None = None) -> np.ndarray:
    """Records for CPU tensors computed by the CUDA kernel's own per-thread code run on the CPU
    (csrc/cuda/scan_cuda.h, scan_on_host), over the work list the CUDA backend would build for a GPU with room for
    `max_blocks` blocks. For tests on machines without a GPU; needs an extension built with nvcc."""
    C = native_module()
    if not hasattr(C, "scan_cuda_on_host"):
        raise RuntimeError("nanscan._C was built without its CUDA part (nvcc was not found at build time)")
    layout = _check_layout(C)
    inputs = as_scan_inputs(inputs)
    if any(torch.device(device).type != "cpu" for device in inputs.devices):
        raise ValueError("scan_records_on_host reads tensors through host addresses: pass CPU tensors")
    table, block_begin = _table_for(_describe(inputs), max_blocks, int(layout["max_chunk_elems"]),
                                    min_block_bytes=min_block_bytes)
    records = np.empty((len(inputs), L.RECORD_WIDTH), dtype=np.int64)
    C.scan_cuda_on_host(table.view(np.uint8), block_begin, records)
    return records


@dataclass
class AsyncScan:
    """A scan enqueued on a CUDA stream. Nothing here has waited for the GPU.

    `found_inf` is a float32 device tensor of shape (), 1.0 when any scanned value is NaN or infinite, else 0.0:
    pass it to a fused optimizer (`optimizer.found_inf = scan.found_inf` before `optimizer.step()` for torch's
    fused Adam/AdamW/SGD) to skip the update without reading it on the host. `records()` waits for the scan and
    returns the (n, record width) int64 records (NOTE: [stats record]); without a host copy (records_to_host=False)
    it copies them from `device_records` then.
    """

    found_inf: torch.Tensor
    device_records: torch.Tensor
    num_tensors: int
    _host_records: torch.Tensor | None = field(repr=False)
    _done: torch.cuda.Event = field(repr=False)
    _keep_alive: tuple = field(default=(), repr=False)  # inputs (and compacted copies), work list: until read

    def ready(self) -> bool:
        """True once the scan (and the copy of its records to the host, if asked for) has finished; never blocks."""
        return self._done.query()

    @property
    def done_event(self) -> torch.cuda.Event:
        """Recorded on the scan's stream after it: a reader of `device_records` on another stream waits for it."""
        return self._done

    def records(self) -> np.ndarray:
        """The records in host memory, waiting for the GPU if it has not finished yet."""
        self._done.synchronize()
        self._keep_alive = ()
        if self._host_records is None:
            self._host_records = self.device_records.cpu()
        return self._host_records.numpy()


class CudaBackend:
    """The CUDA kernel (csrc/cuda/scan_cuda.cu): one launch for all tensors and dtypes of a device."""

    name = "cuda"

    def __init__(self, *, chunk_bytes: int | None = None, min_block_bytes: int | None = None):
        """`chunk_bytes` caps the bytes of one piece (default: only the kernel's own limit) and `min_block_bytes`
        the least a block is given (default MIN_BLOCK_BYTES, or 4 * chunk_bytes when that is given). Tests set
        them small, to spread even tiny tensors over many pieces and blocks."""
        C = native_module()
        if not hasattr(C, "scan_cuda"):
            raise RuntimeError(
                "nanscan._C was built without its CUDA part (no nvcc at build time); rebuild where the CUDA toolkit "
                "is installed: NANSCAN_CUDA=1 pip install --no-build-isolation -e .")
        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                   else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU or driver")
            raise RuntimeError(f"torch.cuda.is_available() is False: {why}")
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
        self._max_chunk_elems = int(layout["max_chunk_elems"])
        self._options = {"max_chunk_bytes": chunk_bytes,
                         "min_block_bytes": min_block_bytes if min_block_bytes is not None or chunk_bytes is None
                         else 4 * chunk_bytes}
        self._probed = {torch.cuda.current_device()}
        self._grid: dict[int, int] = {}  # device index -> blocks that fit on it at once
        # Recent work lists on the device: a training loop scans the same few sets of tensors each step, so they
        # are reused without building or copying them again. Keyed by stream too, because the copy that filled
        # one is ordered on its stream only.
        self._tables: OrderedDict[tuple, _DeviceTable] = OrderedDict()

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray:
        return self.scan_async(inputs).records()

    def scan_async(self, inputs: Sequence[ScanInput], stream: torch.cuda.Stream | None = None, *,
                   records_to_host: bool = True, keep_inputs: bool = True) -> AsyncScan:
        """Enqueue a scan of `inputs` (all on one CUDA device) on `stream` (default: the current stream).

        The kernel reads the tensors when the stream reaches it, so they must not be modified by other streams
        until then (the usual torch stream rule); the returned AsyncScan keeps them alive until its records are
        read. records_to_host=False leaves the records on the device (only `found_inf` and `device_records` are
        written). keep_inputs=False holds no reference to the inputs: right when the scan runs on the stream that
        produced them, whose later allocations are ordered after the scan (holding a step's gradients until the
        next step would keep two sets alive at once).
        """
        inputs = as_scan_inputs(inputs)
        devices = inputs.devices
        if len(devices) > 1:
            raise ValueError(f"scan_async scans one device at a time; got tensors on {sorted(devices)}")
        device = torch.device(devices[0]) if devices else (stream.device if stream is not None
                                                           else torch.device("cuda", torch.cuda.current_device()))
        if device.type != "cuda":
            raise ValueError(f"the cuda backend scans CUDA tensors; got tensors on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        n = len(inputs)
        with torch.cuda.device(index):  # the probe and grid query select the device; this restores the caller's
            if index not in self._probed:
                self._C.cuda_probe(index)
                self._probed.add(index)
            if index not in self._grid:
                self._grid[index] = int(self._C.cuda_grid(index))
            stream = stream if stream is not None else torch.cuda.current_stream(index)
            with torch.cuda.stream(stream):
                work = self._device_table(inputs, index, stream)
                records = torch.empty((n, L.RECORD_WIDTH), dtype=torch.int64, device=device)
                found_inf = torch.empty((), dtype=torch.float32, device=device)
                base = work.device_bytes.data_ptr()
                self._C.scan_cuda(base, work.num_chunks, base + work.block_begin_offset, work.num_blocks,
                                  records.data_ptr(), n, found_inf.data_ptr(), stream.cuda_stream, index)
                host_records = None
                if records_to_host:
                    host_records = torch.empty((n, L.RECORD_WIDTH), dtype=torch.int64, pin_memory=True)
                    host_records.copy_(records, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        return AsyncScan(found_inf=found_inf, device_records=records, num_tensors=n, _host_records=host_records,
                         _done=done, _keep_alive=(work.device_bytes, list(inputs)) if keep_inputs else ())

    def _device_table(self, inputs: ScanInputs, index: int, stream: torch.cuda.Stream) -> "_DeviceTable":
        """The work list on the device (pieces, then block_begin, in one buffer), copied from pinned memory
        without blocking; reused when the same tensors were scanned on this stream recently."""
        described = _describe(inputs)
        key = (index, stream.cuda_stream, PIECE_COST_BYTES, MIN_BLOCK_BYTES, described.tobytes())
        work = self._tables.get(key)
        if work is not None:
            self._tables.move_to_end(key)
            return work
        table, block_begin = _table_for(described, self._grid[index], self._max_chunk_elems, **self._options)
        host_bytes = np.concatenate([table.view(np.uint8), block_begin.view(np.uint8)])
        device_bytes = torch.empty(len(host_bytes), dtype=torch.uint8, device=torch.device("cuda", index))
        device_bytes.copy_(torch.from_numpy(host_bytes).pin_memory(), non_blocking=True)
        work = _DeviceTable(device_bytes=device_bytes, num_chunks=len(table), num_blocks=len(block_begin) - 1,
                            block_begin_offset=table.nbytes)
        self._tables[key] = work
        if len(self._tables) > _CACHED_TABLES:
            self._tables.popitem(last=False)
        return work


@dataclass(frozen=True)
class _DeviceTable:
    device_bytes: torch.Tensor
    num_chunks: int
    num_blocks: int
    block_begin_offset: int  # bytes from the start of device_bytes to block_begin (a multiple of 32)
