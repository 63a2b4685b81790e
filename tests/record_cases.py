"""Stats records the compact encodings must keep exactly (tests/test_compact.py, tests/test_bundle_history.py)."""

from __future__ import annotations

import numpy as np

from nanscan.engine import _layout as L


def adversarial_records() -> np.ndarray:
    """Records the encoding must keep exactly: empty histograms, both end bins, counts past 2**32 and 2**63 - 1."""
    records = L.empty_records(9)
    records[0, L.REC_ZERO] = 4096  # only zeros: an empty histogram
    records[1, L.REC_NAN], records[1, L.REC_POSINF], records[1, L.REC_NEGINF] = 7, 3, 2  # only specials
    records[2, L.REC_HIST] = 1  # bin 0 alone
    records[3, L.REC_HIST + L.HIST_BINS - 1] = 5  # bin 255 alone
    records[4, [L.REC_HIST, L.REC_HIST + L.HIST_BINS - 1]] = (2, 9)  # both ends: the whole width
    records[5, L.REC_HIST + 100] = (1 << 32) + 1  # past uint32
    records[6, L.REC_HIST + 7] = np.iinfo(np.int64).max
    records[7, L.REC_HIST + 40:L.REC_HIST + 60] = np.arange(20) % 3  # zeros inside the range
    records[8, :L.REC_HIST] = (1, 2, 3, 4, 5, 0x7F7FFFFF, 1, 0x3FF0000000000000)
    records[8, L.REC_HIST + 120:L.REC_HIST + 130] = 255
    return records


def random_records(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    records = L.empty_records(rows)
    records[:, :L.REC_HIST] = rng.integers(0, np.iinfo(np.int64).max, size=(rows, L.REC_HIST))
    for r in range(rows):
        first = int(rng.integers(0, L.HIST_BINS))
        width = int(rng.integers(0, L.HIST_BINS - first + 1))
        records[r, L.REC_HIST + first:L.REC_HIST + first + width] = rng.integers(0, 1 << int(rng.integers(1, 40)),
                                                                                size=width)
    return records
