"""The numba backend's fast blocks against the reference: every finite pattern of the 16-bit and one-byte formats in
blocks that take the fused float64 squares (NOTE: [float64 squares], NOTE: [numba bytes]), bfloat16 blocks across
the exponent range (tiny and huge squares, either side of where a float32 square would leave the normal range),
float16 blocks of normal values counted on their own fields, and lengths that leave a tail past the last whole
residue group. Records equal slot by slot (`==`), the sum of squares within SUMSQ_REL_TOL.
"""

from __future__ import annotations

import pytest
import torch

import nanscan
from conftest import FLOAT8_DTYPES, assert_records_match

NUMBA_BLOCK = 1920  # nanscan.engine.backends.numba_cpu._BLOCK_ELEMS
NUMBA_GROUP = 960  # nanscan.engine.backends.numba_blocks.GROUP_ELEMS
LENGTHS = (NUMBA_GROUP - 1, NUMBA_GROUP + 1, NUMBA_BLOCK, NUMBA_BLOCK + NUMBA_GROUP + 7, 3 * NUMBA_BLOCK + 5)


def agree(numba_backend, tensors: dict[str, torch.Tensor]) -> None:
    """The default backend and ones with chunks that end inside a group and on a block, against the reference."""
    from nanscan.engine.backends.numba_cpu import NumbaBackend  # numba is optional: only these tests need the module

    numba_backend.check(tensors)
    want = nanscan.scan(tensors, backend="reference").records
    for chunk in (NUMBA_GROUP + 1, NUMBA_BLOCK, 4 * NUMBA_BLOCK + 3):
        got = nanscan.scan(tensors, backend=NumbaBackend(chunk_elems=chunk)).records
        assert_records_match(got, want, list(tensors), label=f"numba, chunks of {chunk}")


def finite_patterns(dtype: torch.dtype, *, subnormals: bool) -> torch.Tensor:
    """Every pattern of a 16-bit or one-byte format that is zero, normal or (with `subnormals`) subnormal, both
    signs, shuffled."""
    bits = torch.arange(1 << (8 * dtype.itemsize), dtype=torch.int64)
    as_int = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
    values = bits.to(as_int).view(dtype).to(torch.float64)
    keep = values.isfinite() & ((values.abs() >= torch.finfo(dtype).tiny) | (values == 0) | subnormals)
    kept = bits[keep].to(as_int).view(dtype)
    return kept[torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(7))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, *FLOAT8_DTYPES], ids=str)
@pytest.mark.parametrize("subnormals", [False, True], ids=["normal", "with-subnormals"])
def test_every_finite_pattern_in_fast_blocks(numba_backend, dtype, subnormals):
    """No NaN or inf anywhere, so every whole block takes a fast path; cut to several lengths for the tails."""
    x = finite_patterns(dtype, subnormals=subnormals)
    tensors = {"all": x}
    for length in LENGTHS:
        tensors[f"{length} elements"] = x[:length]
        tensors[f"{length} elements from the end"] = x[-length:]
    agree(numba_backend, tensors)


def bfloat16_window(lo_exp: int, hi_exp: int, gen: torch.Generator) -> torch.Tensor:
    """A block of bfloat16 values whose binades span [lo_exp, hi_exp] exactly, a third of them zeros, signs mixed."""
    exps = torch.randint(lo_exp, hi_exp + 1, (NUMBA_BLOCK,), generator=gen)
    exps[:2] = torch.tensor([lo_exp, hi_exp])
    x = (1 + torch.rand(NUMBA_BLOCK, generator=gen, dtype=torch.float64) * 0.99) * 2.0 ** exps.to(torch.float64)
    x[0] = 2.0 ** lo_exp  # the smallest |x| exactly at the bound
    x[1] = 2.0 ** hi_exp * (2 - 2.0 ** -7)  # and the largest bfloat16 below the next binade
    x[5::3] = 0.0
    x[1::4] *= -1
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("lo_exp, hi_exp", [(-63, -63), (-64, -64), (-63, -50), (-64, -50), (50, 63), (50, 64), (-63, 63), (-64, 64),
                                            (-126, -110), (110, 127), (-3, 10)])
def test_bfloat16_blocks_across_the_exponent_range(numba_backend, lo_exp, hi_exp):
    """A bfloat16 block's squares are exact in float64 at both ends of its range (down to 2**-252, up to 2**256) and
    either side of 2**-63 and 2**64, where a float32 square would leave the normal range."""
    gen = torch.Generator().manual_seed(lo_exp * 1000 + hi_exp)
    block = bfloat16_window(lo_exp, hi_exp, gen)
    tensors = {"block": block, "two blocks": torch.cat([block, bfloat16_window(lo_exp, hi_exp, gen)])}
    for length in LENGTHS:
        tensors[f"{length} elements"] = torch.cat([block, block, block, block])[:length]
    agree(numba_backend, tensors)


@pytest.mark.parametrize("lo_exp, hi_exp", [(-14, -14), (-14, 0), (-14, 15), (-10, 5), (0, 15), (15, 15)])
def test_float16_normal_blocks_counted_on_their_own_fields(numba_backend, lo_exp, hi_exp):
    """float16 blocks without subnormals are counted on float16's exponent fields (into the float32 tables from
    field 112), zeros and tails included; the lowest and highest binades sit at both ends of those fields."""
    gen = torch.Generator().manual_seed(100 + lo_exp * 31 + hi_exp)
    n = 4 * NUMBA_BLOCK
    exps = torch.randint(lo_exp, hi_exp + 1, (n,), generator=gen).to(torch.float64)
    x = (1 + torch.rand(n, generator=gen, dtype=torch.float64) * 0.99) * 2.0 ** exps
    x = x.clamp(max=torch.finfo(torch.float16).max)
    x[::5] = 0.0
    x[2::3] *= -1
    x = x.to(torch.float16)
    tensors = {"all": x}
    for length in LENGTHS:
        tensors[f"{length} elements"] = x[:length]
    agree(numba_backend, tensors)


def float8_window(dtype: torch.dtype, field_lo: int, field_hi: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """n one-byte values whose exponent fields span [field_lo, field_hi] exactly (field 0: subnormals), a third
    of them zeros, signs mixed; none is NaN or inf."""
    from nanscan.engine import _layout as L

    f = L.FORMATS[L.DTYPE_CODES[str(dtype).removeprefix("torch.")]]
    fields = torch.randint(field_lo, field_hi + 1, (n,), generator=gen)
    fields[:2] = torch.tensor([field_lo, field_hi])
    mants = torch.randint(0, 1 << f.mant_bits, (n,), generator=gen)
    mants[fields == 0] = mants[fields == 0].clamp(min=1)  # field 0 with mantissa 0 would be a zero
    bits = (fields << f.mant_bits) | mants
    bits[5::3] = 0
    bits[1::4] |= 0x80
    x = bits.to(torch.uint8).view(dtype)
    special = ~x.to(torch.float64).isfinite()
    x = torch.where(special, torch.zeros_like(x), x)  # the top pattern of a window may be NaN or inf
    if dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        x = torch.where(x.view(torch.uint8) == 0x80, torch.zeros_like(x), x)  # 0x80 is their NaN
    return x


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
def test_float8_field_windows(numba_backend, dtype):
    """Blocks whose fields span 1, 15, 16 and 17 fields from each start, with and without subnormals: 5-bit fields
    are counted in one residue word when they span fewer than 16 (zeros taken out of residue 0), in the two-word
    window otherwise; lengths leave tails past the last whole group."""
    from nanscan.engine import _layout as L

    exp_bits = L.FORMATS[L.DTYPE_CODES[str(dtype).removeprefix("torch.")]].exp_bits
    top = (1 << exp_bits) - 1
    gen = torch.Generator().manual_seed(exp_bits)
    tensors = {}
    for span in (1, 15, 16, 17):
        for lo in range(0, top - span + 2):
            x = float8_window(dtype, lo, lo + span - 1, 2 * 3840 + 961, gen)
            tensors[f"fields {lo}..{lo + span - 1}"] = x
            tensors[f"fields {lo}..{lo + span - 1}, 3840 + 959"] = x[:3840 + 959]
    agree(numba_backend, tensors)
