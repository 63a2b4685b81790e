"""The numba backend's residue counters (NOTE: [16-bit words], NOTE: [rotated counts] in
nanscan/engine/backends/numba_blocks.py) against counts taken with numpy: both word forms, the rotating one that AVX-512
machines run and the masked one of AVX2 machines, on every CPU, so the form this machine does not run is checked too.
Counts are compared with `==`, on random bits (signs, NaNs, infinities and subnormals included: the counters see
bits only) and on every 16-bit pattern.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba", reason="the numba backend is optional")

from nanscan.engine.backends import numba_blocks as B  # noqa: E402  (after the importorskip)

# (element width in bits, numpy type, mantissa bits of the formats that use it)
WIDTHS = [(16, np.uint16, 7), (16, np.uint16, 10), (32, np.uint32, 23)]
BLOCK = 2 * B.GROUP_ELEMS


def reference_words(block: np.ndarray, mant_bits: int) -> list[int]:
    """count_residues' four words from numpy: word k, 16-bit slot q counts field mod 16 = 4 q + k over the block's
    whole groups."""
    whole = block[:block.size - block.size % B.GROUP_ELEMS].astype(np.int64)
    counts = np.bincount((whole >> mant_bits) & 0xF, minlength=16)
    return [sum(int(counts[4 * q + k]) << (16 * q) for q in range(4)) for k in range(4)]


def compiled(bits: int, rotates: bool):
    return numba.njit(B.WORD_RESIDUES[(bits, rotates)])


@pytest.mark.parametrize("rotates", [False, True], ids=["masked", "rotated"])
@pytest.mark.parametrize("bits, unsigned, mant_bits", WIDTHS, ids=["bfloat16", "float16", "float32"])
def test_word_forms_count_every_residue(rotates, bits, unsigned, mant_bits):
    counter = compiled(bits, rotates)
    rng = np.random.default_rng(bits * 100 + mant_bits)
    info = np.iinfo(unsigned)
    cases = {
        "random bits": rng.integers(0, info.max, BLOCK, dtype=unsigned, endpoint=True),
        "one residue": np.full(BLOCK, 5 << mant_bits, dtype=unsigned),
        # every element at residue 15 with every other bit set: a mask that leaks shows here
        "all ones": np.full(BLOCK, info.max, dtype=unsigned),
        "a group and a tail": rng.integers(0, info.max, B.GROUP_ELEMS + 37, dtype=unsigned, endpoint=True),
    }
    for name, block in cases.items():
        got = [int(w) for w in counter(block, mant_bits)]
        assert got == reference_words(block, mant_bits), name


@pytest.mark.parametrize("rotates", [False, True], ids=["masked", "rotated"])
@pytest.mark.parametrize("mant_bits", [7, 10], ids=["bfloat16", "float16"])
def test_word_forms_on_every_16_bit_pattern(rotates, mant_bits):
    counter = compiled(16, rotates)
    patterns = np.random.default_rng(mant_bits).permutation(np.arange(1 << 16, dtype=np.uint32)).astype(np.uint16)
    for start in range(0, patterns.size, BLOCK):
        block = patterns[start:start + BLOCK]
        assert [int(w) for w in counter(block, mant_bits)] == reference_words(block, mant_bits), start


def test_the_form_follows_the_features_numba_compiles_for(monkeypatch):
    """host_rotates() reads the features numba's code generator is given: NUMBA_CPU_FEATURES where set (a portable
    build), else the host's; ROTATES is its answer at import."""
    assert B.ROTATES == B.host_rotates()
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+sse2,+avx,+avx2,+fma")
    assert not B.host_rotates()
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx2,+avx512f,+avx512bw")
    assert B.host_rotates()
