"""The numba-cuda backend: the scan as numba CUDA kernels, for GPUs where nanscan._C was built without CUDA.

It states the definitions of classify.h again on raw bits, as nanscan/engine/backends/numba_cpu.py does for the CPU
(exponent field, subnormals binned by their leading mantissa bit, bins clamped to [-128, 127], the float8 formats' own
NaNs and biases, NOTE: [float8 specials]; never isnan or log2), and reads
the tensors in place: no copy, one launch per format, on torch's current stream. It waits for its own results, so it
is slower than the cuda backend's asynchronous scan, but gives the same records. scan_bit_arrays runs the same kernels
on host arrays under numba's CUDA simulator, which is how machines without a GPU test them.

NOTE: [numba-cuda arena]
A numba kernel reads arrays, not a table of raw pointers, and one array argument per tensor would mean one launch (or
one compiled kernel) per tensor. So the tensors of one format on one device are read through a single array, the
arena: it starts at the lowest of their addresses and ends at the end of the highest, and each tensor is a span of
it at (address - base) / element size. Every address on a device lies in one virtual address space, so this is
plain pointer arithmetic; the arena also covers memory between the tensors, which no piece ever reads (the
simulator tests fill those gaps with NaN bits to check it). The tensors' addresses must be multiples of their
element size, as torch's always are.

NOTE: [numba-cuda pieces]
Each tensor is cut into pieces of at most `piece_elems` elements, and blocks take pieces in turn (block b scans
pieces b, b + blocks, ...). A block counts its piece into a shared-memory record with 32-bit atomics (a piece holds
fewer than 2**31 elements), keeps |x| extremes and the sum of squares per thread, then merges them into the tensor's
global record with 64-bit atomics: add for the counts, max/min on the |x| bit patterns (non-negative, so their int64
order is their value order), and a float64 add for the sum of squares, in a separate float64 array because the record
holds it as bits. Counts are therefore exact; the sum of squares depends on the order in which atomics land (its last
bits may vary from run to run). The fingerprint (NOTE: [scan fingerprint] in csrc/include/nanscan/stats_record.h) is
exact too: each thread sums its elements' terms, placed by their index in the tensor (arena index less starts[row],
the arena index of the tensor's element 0), as uint64, and the block's sum is added to the record with a 64-bit
atomic add, which wraps as the sum mod 2**64 does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np
import torch

try:
    import numba
    from numba import cuda
except ImportError as exc:  # pragma: no cover - numba is a dependency, but an optional one
    raise ImportError(f"the numba-cuda backend needs numba with its CUDA target ({exc}); install it with "
                      "`pip install numba-cuda`, or let nanscan use the reference backend on GPUs") from exc

from nanscan.engine import _layout as L
from nanscan.engine.inputs import ScanInput, as_scan_inputs, prepare

DEFAULT_THREADS = 256
DEFAULT_PIECE_ELEMS = 1 << 16
BLOCKS_PER_SM = 4  # resident blocks asked for per multiprocessor: enough to hide the latency of the reads
_MAX_PIECE_ELEMS = (1 << 31) - 1  # the shared-memory counters are int32 (NOTE: [numba-cuda pieces])

# Columns of the piece table (int64): arena index of the first element, one past the last, record row.
PIECE_BEGIN, PIECE_END, PIECE_ROW = 0, 1, 2

# Record slots and histogram geometry as plain globals: numba freezes them into the compiled kernels.
_REC_NAN, _REC_POSINF, _REC_NEGINF = L.REC_NAN, L.REC_POSINF, L.REC_NEGINF
_REC_ZERO, _REC_SUBNORMAL, _REC_HIST = L.REC_ZERO, L.REC_SUBNORMAL, L.REC_HIST
_REC_ABSMAX, _REC_ABSMIN, _REC_FINGERPRINT = L.REC_ABSMAX_BITS, L.REC_ABSMIN_BITS, L.REC_FINGERPRINT
_RECORD_WIDTH = L.RECORD_WIDTH
_MIN_BIN, _MAX_BIN = L.MIN_BIN_EXPONENT, L.MAX_BIN_EXPONENT
_ABSMIN_NONE = L.ABSMIN_NONE


class _Format(NamedTuple):
    """Field widths, exponent bias and specials of one format (classify.h, FloatFormat;
    nanscan.engine._layout.FORMATS)."""

    exp_bits: int
    mant_bits: int
    bias: int
    specials: int

    def scale(self) -> np.ndarray:
        """scale[field] = 2**(field - bias - mant_bits), scale[0] that of field 1: |x| = significand * scale[field],
        exactly, for every finite value (the kernels have no bit cast from integer to float)."""
        fields = np.maximum(np.arange(1 << self.exp_bits), 1)
        return np.ldexp(1.0, fields - self.bias - self.mant_bits)


_FORMATS = {code: _Format(f.exp_bits, f.mant_bits, f.bias, f.specials) for code, f in L.FORMATS.items()}


# -- kernels --------------------------------------------------------------------------------------------------------

@functools.cache
def _kernel(code: int):
    """The scan kernel of one format (NOTE: [numba-cuda arena], NOTE: [numba-cuda pieces]), compiled on first launch.

    kernel[blocks, threads, stream](arena, pieces, starts, scale, records, sumsq): arena holds the elements' bits
    (uint8, uint16, uint32 or uint64), pieces the int64 piece table, starts (n,) int64 each record row's arena index
    of its tensor's element 0, scale the format's _Format.scale(); records (n, RECORD_WIDTH) int64 and sumsq (n,)
    float64 start in their identity state and are merged into.
    """
    fmt = _FORMATS[code]
    # Every constant that meets a bit pattern is a uint64: numba turns uint64 mixed with int64 into float64. Casts and
    # dtypes in the kernel are numpy's, which numba's built-in CUDA target, numba-cuda (whose type system is its own
    # in recent versions) and the simulator all accept.
    mant_shift = np.uint64(fmt.mant_bits)
    mant_mask = np.uint64((1 << fmt.mant_bits) - 1)
    hidden = np.uint64(1 << fmt.mant_bits)
    field_mask = np.uint64((1 << fmt.exp_bits) - 1)
    sign_mask = np.uint64(1 << (fmt.exp_bits + fmt.mant_bits))
    abs_mask = np.uint64((1 << (fmt.exp_bits + fmt.mant_bits)) - 1)
    exp_max = (1 << fmt.exp_bits) - 1
    bias = fmt.bias
    subnormal_exponent = 1 - fmt.bias - fmt.mant_bits  # floor(log2|x|) of a subnormal is this + its highest bit
    # Where the format keeps its NaNs and infinities (classify.h, NOTE: [float8 specials]): constants, so each
    # format's kernel keeps only its own tests.
    ieee = fmt.specials == L.IEEE_SPECIALS
    nan_all_ones = fmt.specials == L.NAN_ALL_ONES
    nan_neg_zero = fmt.specials == L.NAN_NEG_ZERO

    @cuda.jit
    def scan_pieces(arena, pieces, starts, scale, records, sumsq):
        counts = cuda.shared.array(_RECORD_WIDTH, np.int32)  # slots as in the record; 5-7 and the last stay 0
        extremes = cuda.shared.array(2, np.int64)  # largest |x| bits, smallest non-zero |x| bits
        piece_sumsq = cuda.shared.array(1, np.float64)
        piece_fingerprint = cuda.shared.array(1, np.uint64)
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        for piece in range(cuda.blockIdx.x, pieces.shape[0], cuda.gridDim.x):
            for k in range(tid, _RECORD_WIDTH, threads):
                counts[k] = 0
            if tid == 0:
                extremes[0] = 0
                extremes[1] = _ABSMIN_NONE
                piece_sumsq[0] = 0.0
                piece_fingerprint[0] = np.uint64(0)
            cuda.syncthreads()
            absmax = np.int64(0)
            absmin = np.int64(_ABSMIN_NONE)
            s = 0.0
            row = pieces[piece, PIECE_ROW]
            start = starts[row]
            fingerprint = np.uint64(0)
            for i in range(pieces[piece, PIECE_BEGIN] + tid, pieces[piece, PIECE_END], threads):
                bits = np.uint64(arena[i])
                # NOTE: [scan fingerprint]: mix(u) * (2 index + 1), every operand uint64.
                odd = np.uint64(2) * np.uint64(i - start) + np.uint64(1)
                fingerprint += (bits ^ (bits >> np.uint64(32))) * odd
                field = np.int64((bits >> mant_shift) & field_mask)
                mant = bits & mant_mask
                if (nan_all_ones and (bits & abs_mask) == abs_mask) or (nan_neg_zero and bits == sign_mask):
                    cuda.atomic.add(counts, _REC_NAN, 1)
                elif ieee and field == exp_max:
                    if mant != 0:
                        cuda.atomic.add(counts, _REC_NAN, 1)
                    elif bits & sign_mask:
                        cuda.atomic.add(counts, _REC_NEGINF, 1)
                    else:
                        cuda.atomic.add(counts, _REC_POSINF, 1)
                elif field == 0 and mant == 0:
                    cuda.atomic.add(counts, _REC_ZERO, 1)
                else:
                    if field == 0:
                        cuda.atomic.add(counts, _REC_SUBNORMAL, 1)
                        # The leading mantissa bit sets the binade (classify.h, bin_of_subnormal). A shift ladder
                        # rather than cuda.clz: subnormals are rare, and the simulator's clz reads 32 bits only.
                        top = 0
                        rest = mant
                        shift = 32
                        while shift > 0:
                            if rest >> np.uint64(shift):
                                rest >>= np.uint64(shift)
                                top += shift
                            shift >>= 1
                        exponent = subnormal_exponent + top
                        value = np.float64(mant) * scale[0]
                    else:
                        exponent = field - bias
                        value = np.float64(mant | hidden) * scale[field]
                    # classify.h, clamp_to_bin. Comparisons rather than min/max: numba's CUDA target compiles those
                    # builtins as device functions, which one version here failed to type.
                    if exponent < _MIN_BIN:
                        exponent = _MIN_BIN
                    elif exponent > _MAX_BIN:
                        exponent = _MAX_BIN
                    cuda.atomic.add(counts, _REC_HIST + exponent - _MIN_BIN, 1)
                    a = np.int64(bits & abs_mask)
                    if a > absmax:
                        absmax = a
                    if a < absmin:
                        absmin = a
                    s += value * value
            # Only threads that saw a finite non-zero value have anything to merge; 0 is absmax's identity.
            if absmin != _ABSMIN_NONE:
                cuda.atomic.max(extremes, 0, absmax)
                cuda.atomic.min(extremes, 1, absmin)
                cuda.atomic.add(piece_sumsq, 0, s)
            if fingerprint != np.uint64(0):
                cuda.atomic.add(piece_fingerprint, 0, fingerprint)
            cuda.syncthreads()
            for k in range(tid, _RECORD_WIDTH, threads):
                c = counts[k]
                if c != 0:
                    cuda.atomic.add(records, (row, k), np.int64(c))
            if tid == 0 and extremes[1] != _ABSMIN_NONE:
                cuda.atomic.max(records, (row, _REC_ABSMAX), extremes[0])
                cuda.atomic.min(records, (row, _REC_ABSMIN), extremes[1])
                cuda.atomic.add(sumsq, row, piece_sumsq[0])
            if tid == 0 and piece_fingerprint[0] != np.uint64(0):
                cuda.atomic.add(records, (row, _REC_FINGERPRINT), np.int64(piece_fingerprint[0]))
            cuda.syncthreads()  # the next piece clears the shared record only after every thread has merged it

    return scan_pieces


def launch_pieces(code: int, arena, pieces, starts, scale, records, sumsq, *, blocks: int, threads: int,
                  stream=0) -> None:
    """Enqueue the kernel of format `code` over a non-empty piece table. The arrays are CUDA arrays (anything with a
    __cuda_array_interface__) on a GPU, or numpy arrays under the simulator (NUMBA_ENABLE_CUDASIM=1); the kernel is
    the same."""
    _kernel(code)[blocks, threads, stream](arena, pieces, starts, scale, records, sumsq)


def arena_starts(ptrs: np.ndarray, base: int, itemsize: int) -> np.ndarray:
    """Each input's arena index of its element 0 (NOTE: [numba-cuda arena]), for the fingerprint's index; inputs of
    other formats get values no piece reads."""
    return (np.asarray(ptrs, dtype=np.int64) - base) // itemsize


# -- host side ------------------------------------------------------------------------------------------------------

def plan_group(ptrs: np.ndarray, numels: np.ndarray, rows: np.ndarray, itemsize: int,
               piece_elems: int) -> tuple[int, int, np.ndarray]:
    """(base address, arena length in elements, piece table) for tensors of one format (NOTE: [numba-cuda arena],
    NOTE: [numba-cuda pieces]). Empty tensors get no piece; with none left, base and length are 0."""
    ptrs = np.asarray(ptrs, dtype=np.int64)
    numels = np.asarray(numels, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    _check_piece_elems(piece_elems)
    keep = numels > 0
    ptrs, numels, rows = ptrs[keep], numels[keep], rows[keep]
    if not len(numels):
        return 0, 0, np.empty((0, 3), dtype=np.int64)
    misaligned = np.flatnonzero(ptrs % itemsize != 0)
    if len(misaligned):
        i = int(misaligned[0])
        raise ValueError(f"tensor at record row {int(rows[i])} starts at address {int(ptrs[i]):#x}, not a multiple "
                         f"of its element size {itemsize}; the numba-cuda scan needs element-aligned tensors (pass a "
                         ".contiguous() copy)")
    base = int(ptrs.min())
    first = (ptrs - base) // itemsize
    counts = -(-numels // piece_elems)
    owner = np.repeat(np.arange(len(numels)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    pieces = np.empty((len(owner), 3), dtype=np.int64)
    pieces[:, PIECE_BEGIN] = first[owner] + k * piece_elems
    pieces[:, PIECE_END] = np.minimum(pieces[:, PIECE_BEGIN] + piece_elems, (first + numels)[owner])
    pieces[:, PIECE_ROW] = rows[owner]
    return base, int((first + numels).max()), pieces


def plan_scan(ptrs: np.ndarray, numels: np.ndarray, codes: np.ndarray, piece_elems: int):
    """(format code, base address, arena length, piece table) per format with a non-empty tensor, for an input
    table (nanscan.engine.inputs.ScanInputs.table(): addresses, element counts, format codes); piece rows index its
    inputs."""
    ptrs = np.asarray(ptrs, dtype=np.int64)
    numels = np.asarray(numels, dtype=np.int64)
    codes = np.asarray(codes, dtype=np.int32)
    plans = []
    for code in np.unique(codes[numels > 0]).tolist():
        rows = np.flatnonzero((codes == code) & (numels > 0))
        plans.append((code, *plan_group(ptrs[rows], numels[rows], rows, L.FORMATS[code].bytes, piece_elems)))
    return plans


def _check_piece_elems(piece_elems: int) -> None:
    if not 1 <= piece_elems <= _MAX_PIECE_ELEMS:
        raise ValueError(f"piece_elems={piece_elems} must be between 1 and {_MAX_PIECE_ELEMS} (the kernels count a "
                         "piece in int32)")


def finish_records(records: np.ndarray, sumsq: np.ndarray) -> np.ndarray:
    """The kernels' records with their float64 sums of squares stored as bits in the record's slot."""
    records[:, L.REC_SUMSQ] = np.asarray(sumsq, dtype=np.float64).view(np.int64)
    return records


def scan_bit_arrays(arrays: Sequence[np.ndarray], codes: Sequence[int], *, threads: int = DEFAULT_THREADS,
                    blocks: int = 1, piece_elems: int = DEFAULT_PIECE_ELEMS, guard_elems: int = 3) -> np.ndarray:
    """Records for host arrays of raw bits (arrays[i] holds codes[i]'s bits: uint16, uint32 or uint64), computed by
    the backend's kernels on host arrays: for tests under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set before
    numba is imported). The arrays of each format are laid out as the backend finds tensors in memory, in one arena
    with `guard_elems` NaN patterns around each (a correct scan never reads them), and planned and merged by the
    backend's own code."""
    codes = np.asarray(codes, dtype=np.int32)
    ptrs = np.zeros(len(arrays), dtype=np.int64)
    numels = np.array([np.asarray(a).size for a in arrays], dtype=np.int64)
    arenas = {}
    for code in np.unique(codes).tolist():
        bits_dtype = L.BITS_DTYPES[code]
        # A NaN: all ones, except in the fnuz formats, whose one NaN is the sign bit alone (all ones is -57344 there)
        nan = 0x80 if L.FORMATS[code].specials == L.NAN_NEG_ZERO else np.iinfo(bits_dtype).max
        guard = np.full(guard_elems, nan, dtype=bits_dtype)
        rows = np.flatnonzero(codes == code)
        parts, starts, at = [guard], [], guard_elems
        for row in rows:
            data = np.asarray(arrays[row])
            if data.dtype != bits_dtype:
                raise TypeError(f"array {row} holds {data.dtype}; {L.DTYPE_NAMES[code]} bits are {bits_dtype}")
            parts += [data.ravel(), guard]
            starts.append(at)
            at += data.size + guard_elems
        arena = arenas[code] = np.concatenate(parts)
        ptrs[rows] = arena.ctypes.data + np.asarray(starts, dtype=np.int64) * arena.itemsize
    records = L.empty_records(len(arrays))
    sumsq = np.zeros(len(arrays), dtype=np.float64)
    for code, base, length, pieces in plan_scan(ptrs, numels, codes, piece_elems):
        arena = arenas[code]
        first = (base - arena.ctypes.data) // arena.itemsize
        # The simulator runs the kernels as Python: their uint64 sums wrap as numpy scalars, which warn.
        with np.errstate(over="ignore"):
            launch_pieces(code, arena[first:first + length], pieces, arena_starts(ptrs, base, arena.itemsize),
                          _FORMATS[code].scale(), records, sumsq, blocks=blocks, threads=threads)
    return finish_records(records, sumsq)


class _DeviceSpan:
    """Device memory described by the CUDA array interface (version 3), for kernel arguments. It names no stream,
    so numba does not synchronize on it: the launches and copies of a scan are all on one stream already."""

    __slots__ = ("__cuda_array_interface__", "_owner")

    def __init__(self, address: int, shape: tuple[int, ...], dtype, owner=None):
        # Not marked read-only even where the kernel only reads: nothing is gained, and consumers differ on it.
        self.__cuda_array_interface__ = {"shape": tuple(int(d) for d in shape), "typestr": np.dtype(dtype).str,
                                         "data": (int(address), False), "strides": None, "version": 3,
                                         "stream": None}
        self._owner = owner  # keeps a torch tensor's memory alive while the span is in use

    @classmethod
    def of(cls, t: torch.Tensor) -> "_DeviceSpan":
        """A span over a contiguous int64 or float64 tensor made by this module."""
        dtype = {torch.int64: np.int64, torch.float64: np.float64}[t.dtype]
        return cls(t.data_ptr(), tuple(t.shape), dtype, owner=t)


class NumbaCudaBackend:
    """numba CUDA kernels over the tensors in place (NOTE: [numba-cuda arena]); waits for its own results."""

    name = "numba-cuda"

    def __init__(self, *, threads: int = DEFAULT_THREADS, blocks: int | None = None,
                 piece_elems: int = DEFAULT_PIECE_ELEMS):
        """`blocks` caps the blocks of a launch (default: BLOCKS_PER_SM per multiprocessor); `threads` and
        `piece_elems` set the block size and the piece length. Tests set them small to force many pieces."""
        if numba.config.ENABLE_CUDASIM:
            raise RuntimeError("NUMBA_ENABLE_CUDASIM=1 makes numba.cuda a CPU simulator, which cannot read CUDA "
                               "tensors; unset it to scan on the GPU")
        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                   else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU or driver")
            raise RuntimeError(f"torch.cuda.is_available() is False: {why}")
        if not cuda.is_available():
            raise RuntimeError(f"numba.cuda finds no usable GPU ({cuda.cuda_error()}); install numba-cuda for this "
                               "CUDA version (pip install numba-cuda[cu12] or [cu13]), or use the reference backend")
        if threads < 1 or threads > 1024 or (blocks is not None and blocks < 1):
            raise ValueError(f"threads={threads} must be in [1, 1024] and blocks={blocks} at least 1")
        _check_piece_elems(piece_elems)
        self.threads = threads
        self.blocks = blocks
        self.piece_elems = piece_elems
        self._scales: dict[tuple[int, int], torch.Tensor] = {}  # (device index, format) -> scale table
        self._probe()

    def _probe(self) -> None:
        """Compile and run the kernels once on a known tensor. numba's CUDA target can import and see the GPU and
        still fail to compile (a numba-cuda release older than the installed numpy, say): that must make this
        backend unavailable, so that auto selection moves on to the reference backend, not fail every scan."""
        try:
            probe = torch.tensor([1.0, float("nan"), 0.0], device=torch.device("cuda", torch.cuda.current_device()))
            records = self.scan_records([prepare("probe", probe)])
        except Exception as exc:  # noqa: BLE001 - whatever breaks inside numba, the backend cannot run here
            raise RuntimeError(f"numba's CUDA target cannot compile or run nanscan's kernels here "
                               f"({type(exc).__name__}: {exc}); install a numba-cuda release that matches this "
                               "numpy and CUDA, or build nanscan's CUDA extension (NANSCAN_CUDA=1)") from exc
        if (records[0, L.REC_NAN], records[0, L.REC_ZERO]) != (1, 1):
            raise RuntimeError(f"numba-cuda's probe scan of [1, nan, 0] counted {records[0, L.REC_NAN]} NaN and "
                               f"{records[0, L.REC_ZERO]} zeros; its kernels do not run correctly on this GPU")

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray:
        inputs = as_scan_inputs(inputs)
        n = len(inputs)
        if n == 0:
            return L.empty_records(0)
        devices = inputs.devices
        if len(devices) > 1:
            raise ValueError(f"the numba-cuda backend scans one device at a time; got tensors on {list(devices)}")
        device = torch.device(devices[0])
        if device.type != "cuda":
            raise ValueError(f"the numba-cuda backend scans CUDA tensors; got tensors on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        ptrs, numels, codes = inputs.table()
        with torch.cuda.device(index), cuda.gpus[index]:
            stream = cuda.external_stream(torch.cuda.current_stream(index).cuda_stream)
            records = _to_device(L.empty_records(n), device)
            sumsq = torch.zeros(n, dtype=torch.float64, device=device)
            blocks = self.blocks or BLOCKS_PER_SM * torch.cuda.get_device_properties(index).multi_processor_count
            for code, base, length, pieces in plan_scan(ptrs, numels, codes, self.piece_elems):
                # The arena is read in place (NOTE: [numba-cuda arena]); the inputs outlive this call.
                arena = _DeviceSpan(base, (length,), L.BITS_DTYPES[code])
                starts = _to_device(arena_starts(ptrs, base, L.FORMATS[code].bytes), device)
                launch_pieces(code, arena, _DeviceSpan.of(_to_device(pieces, device)), _DeviceSpan.of(starts),
                              _DeviceSpan.of(self._scale(code, index)), _DeviceSpan.of(records), _DeviceSpan.of(sumsq),
                              blocks=min(blocks, len(pieces)), threads=self.threads, stream=stream)
            host_records = records.cpu().numpy()  # a copy on the current stream: it waits for the kernels
            host_sumsq = sumsq.cpu().numpy()
        return finish_records(host_records, host_sumsq)

    def _scale(self, code: int, index: int) -> torch.Tensor:
        key = (index, code)
        if key not in self._scales:
            self._scales[key] = _to_device(_FORMATS[code].scale(), torch.device("cuda", index))
        return self._scales[key]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy of a host array on `device`, ordered on the current stream."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
