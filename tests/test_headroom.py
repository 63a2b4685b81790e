"""nanscan.engine.headroom on hand-built exponent histograms (binades that overflow, turn subnormal or flush to zero in
float16, bfloat16 and the float8 formats) and against torch's own casts: float32 values from every binade, random
data of several scales with the formats' edges planted, and every float16 and bfloat16 pattern, scanned and then
cast; the two agree except for the values the headroom module docstring lists, and those are checked to be
exactly as listed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nanscan
from nanscan.engine import _layout as L
from nanscan.engine.headroom import FORMATS


def hist_of(*binades: int, count: int = 1) -> np.ndarray:
    """A 256-bin exponent histogram with `count` values in each given binade (floor(log2|x|))."""
    hist = np.zeros(L.HIST_BINS, dtype=np.int64)
    for binade in binades:
        hist[binade - L.MIN_BIN_EXPONENT] += count
    return hist


def by_format(hist) -> dict:
    return {h.format: h for h in nanscan.headroom(hist)}


def test_formats_reported():
    assert list(by_format(hist_of(0))) == ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]


def test_two_to_the_16_overflows_float16_but_not_bfloat16():
    result = by_format(hist_of(16))
    assert result["float16"].overflow == 1.0
    assert result["bfloat16"].overflow == 0.0
    assert result["float16"].binades_to_overflow == -1
    assert result["bfloat16"].binades_to_overflow == 127 - 16


def test_float16_top_binade_counts_as_fitting():
    # 2**15 <= x < 2**16 holds float16's largest finite value 65504; binade granularity counts all of it as fitting.
    assert by_format(hist_of(15))["float16"].overflow == 0.0
    assert by_format(hist_of(15))["float16"].binades_to_overflow == 0


def test_float16_subnormal_and_underflow_boundaries():
    assert by_format(hist_of(-26))["float16"].underflow == 1.0  # below 2**-25, half the smallest subnormal
    assert by_format(hist_of(-26))["float16"].subnormal == 0.0
    # [2**-25, 2**-24) rounds up to the smallest subnormal 2**-24, all but 2**-25 itself (a tie, to zero)
    assert by_format(hist_of(-25))["float16"].subnormal == 1.0
    assert by_format(hist_of(-25))["float16"].underflow == 0.0
    assert by_format(hist_of(-24))["float16"].subnormal == 1.0  # the smallest subnormal itself
    assert by_format(hist_of(-20))["float16"].subnormal == 1.0
    assert by_format(hist_of(-20))["float16"].underflow == 0.0
    assert by_format(hist_of(-15))["float16"].subnormal == 1.0
    assert by_format(hist_of(-14))["float16"].subnormal == 0.0  # the smallest normal
    assert by_format(hist_of(-20))["bfloat16"].subnormal == 0.0


@pytest.mark.parametrize("binade, overflow, subnormal, underflow", [
    (9, 1.0, 0.0, 0.0),    # 512 > 448, the largest e4m3fn value
    (8, 0.0, 0.0, 0.0),    # 256 <= x < 512 holds 448
    (-6, 0.0, 0.0, 0.0),   # the smallest normal
    (-7, 0.0, 1.0, 0.0),
    (-9, 0.0, 1.0, 0.0),   # the smallest subnormal, 2**-9
    (-10, 0.0, 1.0, 0.0),  # rounds up to 2**-9
    (-11, 0.0, 0.0, 1.0),
])
def test_float8_e4m3fn_boundaries(binade, overflow, subnormal, underflow):
    h = by_format(hist_of(binade))["float8_e4m3fn"]
    assert (h.overflow, h.subnormal, h.underflow) == (overflow, subnormal, underflow)


@pytest.mark.parametrize("binade, overflow, subnormal, underflow", [
    (16, 1.0, 0.0, 0.0),
    (15, 0.0, 0.0, 0.0),    # holds 57344, the largest e5m2 value
    (-14, 0.0, 0.0, 0.0),
    (-15, 0.0, 1.0, 0.0),
    (-16, 0.0, 1.0, 0.0),   # the smallest subnormal
    (-17, 0.0, 1.0, 0.0),   # rounds up to 2**-16
    (-18, 0.0, 0.0, 1.0),
])
def test_float8_e5m2_boundaries(binade, overflow, subnormal, underflow):
    h = by_format(hist_of(binade))["float8_e5m2"]
    assert (h.overflow, h.subnormal, h.underflow) == (overflow, subnormal, underflow)


def test_fractions_of_a_mixed_histogram():
    hist = hist_of(0, count=6) + hist_of(16, count=1) + hist_of(-20, count=2) + hist_of(-30, count=1)
    h = by_format(hist)["float16"]
    assert h.values == 10
    assert (h.overflow, h.subnormal, h.underflow) == (0.1, 0.2, 0.1)
    assert h.top_binade == 16
    b = by_format(hist)["bfloat16"]
    assert (b.overflow, b.subnormal, b.underflow) == (0.0, 0.0, 0.0)


def test_bfloat16_below_the_clamped_end_bin_is_subnormal_not_underflow():
    # Bin 0 holds every value below 2**-127, so bfloat16's subnormal/zero split there cannot be resolved.
    h = by_format(hist_of(L.MIN_BIN_EXPONENT, count=4))["bfloat16"]
    assert (h.subnormal, h.underflow) == (1.0, 0.0)


def test_empty_histogram():
    for h in nanscan.headroom(np.zeros(L.HIST_BINS, dtype=np.int64)):
        assert (h.values, h.overflow, h.subnormal, h.underflow) == (0, 0.0, 0.0, 0.0)
        assert h.top_binade is None and h.binades_to_overflow is None


@pytest.mark.parametrize("bad", [np.zeros(255), np.zeros((2, 256)), np.zeros(0), 7])
def test_wrong_shape_raises(bad):
    with pytest.raises(ValueError, match="exp_hist must have 256 bins"):
        nanscan.headroom(bad)


def test_from_a_real_scan():
    x = torch.tensor([2.0 ** 16, 3.0 * 2.0 ** 16, 1.0, 2.0 ** -20, 0.0, float("nan")])
    stats = nanscan.scan({"x": x})["x"]
    h = by_format(stats.exp_hist)
    assert h["float16"].values == 4  # zeros and NaN are counted, not binned
    assert (h["float16"].overflow, h["float16"].subnormal) == (0.5, 0.25)
    assert h["bfloat16"].overflow == 0.0 and h["float16"].top_binade == 17
    assert h["float16"].to_dict()["format"] == "float16"


def test_float64_values_above_the_clamped_top_bin_count_as_fitting_bfloat16():
    # Bin 255 holds 2**127 and everything above it: 1e300 would overflow bfloat16 but is counted as fitting, as the
    # headroom docstring says; absmax is what tells such a tensor apart.
    stats = nanscan.scan({"x": torch.tensor([1e300, 2.0 ** 127], dtype=torch.float64)})["x"]
    h = by_format(stats.exp_hist)["bfloat16"]
    assert (h.overflow, h.top_binade, h.binades_to_overflow) == (0.0, 127, 0)
    assert torch.isinf(torch.tensor([1e300], dtype=torch.float64).to(torch.bfloat16)).all()
    assert stats.absmax == 1e300


# -- against torch's casts ----------------------------------------------------------------------------------------

CAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
               "float8_e5m2": torch.float8_e5m2}
NORMAL, SUBNORMAL, ZERO, OVERFLOW = range(4)  # what a cast makes of a finite non-zero value

# The values the headroom module docstring lists as counted on another side than a cast puts them, per format.
# Top of the range: the first magnitude that rounds above the largest finite value, and whether that tie itself
# does (it rounds to even: up where the largest value's last mantissa bit is odd).
ROUNDS_ABOVE_MAX = {"float16": (65520.0, True), "bfloat16": (2.0 ** 128 - 2.0 ** 119, True),
                    "float8_e4m3fn": (464.0, False), "float8_e5m2": (61440.0, True)}
# Below the smallest normal: from here up (the tie included, it rounds to the even smallest normal) a value becomes
# the smallest normal, though its binade is counted as subnormal.
ROUNDS_UP_TO_NORMAL = {"float16": 2.0 ** -14 - 2.0 ** -25, "bfloat16": 2.0 ** -126 - 2.0 ** -134,
                       "float8_e4m3fn": 1.875 * 2.0 ** -7, "float8_e5m2": 1.75 * 2.0 ** -15}


def smallest_subnormal(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def cast_fates(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NORMAL/SUBNORMAL/ZERO/OVERFLOW per value of `x` (finite, non-zero) after torch's cast to `dtype`.

    Overflow is an infinity, a NaN, or (float8_e4m3fn, which has no infinity) a result further from the value
    than half the spacing at the top of the range: the cast saturated rather than rounded."""
    finfo = torch.finfo(dtype)
    wide = x.to(torch.float64)
    cast = x.to(dtype).to(torch.float64)
    half_top_spacing = 2.0 ** np.floor(np.log2(finfo.max)) * finfo.eps / 2
    fates = torch.full(x.shape, NORMAL, dtype=torch.int64)
    fates[(cast != 0) & (cast.abs() < finfo.smallest_normal)] = SUBNORMAL
    fates[cast == 0] = ZERO
    fates[~torch.isfinite(cast) | ((wide - cast).abs() > half_top_spacing)] = OVERFLOW
    return fates


def documented_fates(x: torch.Tensor, fmt: str, fates: torch.Tensor) -> torch.Tensor:
    """The cast's fates with the module docstring's exceptions applied: what headroom must count."""
    dtype = CAST_DTYPES[fmt]
    a = x.to(torch.float64).abs()
    top, tie_overflows = ROUNDS_ABOVE_MAX[fmt]
    max_binade_end = 2.0 ** (int(np.log2(torch.finfo(dtype).max)) + 1)
    out = fates.clone()
    out[((a >= top) if tie_overflows else (a > top)) & (a < max_binade_end)] = NORMAL
    out[(a >= ROUNDS_UP_TO_NORMAL[fmt]) & (a < torch.finfo(dtype).smallest_normal)] = SUBNORMAL
    out[a == smallest_subnormal(dtype) / 2] = SUBNORMAL
    if fmt == "bfloat16":  # the clamped bin 0 (below 2**-127) is reported as subnormal
        out[a < 2.0 ** (L.MIN_BIN_EXPONENT + 1)] = SUBNORMAL
    return out


def assert_headroom_matches_casts(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Scan the tensors (finite, non-zero values), then cast each to every format; headroom must count what the
    cast does, moved as documented. Returns how many values each exception moved, so a test can check it ran."""
    report = nanscan.scan(tensors)
    moved = {fmt: 0 for fmt in CAST_DTYPES}
    for name, x in tensors.items():
        assert torch.isfinite(x).all() and (x != 0).all(), f"{name}: test data must be finite and non-zero"
        for h in nanscan.headroom(report[name].exp_hist):
            fates = cast_fates(x, CAST_DTYPES[h.format])
            want = documented_fates(x, h.format, fates)
            moved[h.format] += int((want != fates).sum())
            n = x.numel()
            share = {fate: int((want == fate).sum()) / n for fate in (OVERFLOW, SUBNORMAL, ZERO)}
            got = {OVERFLOW: h.overflow, SUBNORMAL: h.subnormal, ZERO: h.underflow}
            assert h.values == n and got == share, (
                f"{name} in {h.format}: headroom overflow/subnormal/underflow {got[OVERFLOW]}/{got[SUBNORMAL]}/"
                f"{got[ZERO]}, the cast (documented exceptions applied) {share[OVERFLOW]}/{share[SUBNORMAL]}/"
                f"{share[ZERO]}; cast fates {torch.bincount(fates, minlength=4).tolist()}")
    return moved


def float32_neighbours(values) -> list[float]:
    """Each value rounded to float32 and its float32 neighbours on both sides."""
    v = np.asarray(values, dtype=np.float32)
    return np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))]).tolist()


def format_edges() -> list[float]:
    """Every edge of every format with its float32 neighbours: largest finite, the first value rounding above it,
    the smallest normal and where values start rounding up to it, the smallest subnormal and half of it."""
    edges = []
    for fmt, dtype in CAST_DTYPES.items():
        finfo = torch.finfo(dtype)
        edges += [finfo.max, ROUNDS_ABOVE_MAX[fmt][0], finfo.smallest_normal, ROUNDS_UP_TO_NORMAL[fmt],
                  smallest_subnormal(dtype), smallest_subnormal(dtype) / 2, smallest_subnormal(dtype) * 1.5]
    return [e for e in float32_neighbours(edges) if 0 < e < np.inf]


def test_every_float32_binade_against_the_casts():
    gen = torch.Generator().manual_seed(11)
    edges = np.abs(np.array(format_edges(), dtype=np.float32))
    tensors = {}
    for binade in range(-149, 128):
        low = np.float32(2.0 ** binade)
        high = np.nextafter(np.float32(2.0 ** (binade + 1)) if binade < 127 else np.float32(np.inf), np.float32(0))
        mantissas = 1 + torch.rand(64, generator=gen, dtype=torch.float64)
        values = [low, np.nextafter(low, np.float32(np.inf)), high, *edges[(edges >= low) & (edges <= high)]]
        x = torch.cat([torch.tensor(values, dtype=torch.float32), (mantissas * 2.0 ** binade).to(torch.float32)])
        x = x[(x != 0) & torch.isfinite(x)]  # float32 subnormal binades hold fewer than 64 distinct values
        signs = torch.randint(0, 2, x.shape, generator=gen) * 2 - 1
        tensors[f"2**{binade}"] = x * signs
    moved = assert_headroom_matches_casts(tensors)
    assert all(moved.values()), f"every format's documented exceptions must come up in the data: {moved}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_against_the_casts(dtype):
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x) & (x != 0)]
    assert_headroom_matches_casts({"patterns": x})
    # In its own format every value is kept as it is: the subnormal share is the scan's own subnormal count.
    stats = nanscan.scan({"patterns": x})["patterns"]
    own = by_format(stats.exp_hist)[str(dtype).removeprefix("torch.")]
    assert (own.overflow, own.underflow, own.subnormal) == (0.0, 0.0, stats.subnormal / x.numel())


@pytest.mark.parametrize("log2_scale", [-140, -40, -22, -12, -5, 0, 8, 14, 20, 60, 125])
def test_random_float32_data_with_the_edges_planted(log2_scale):
    gen = torch.Generator().manual_seed(log2_scale + 1000)
    x = torch.randn(20_000, generator=gen, dtype=torch.float64) * 2.0 ** log2_scale
    x = torch.cat([x.to(torch.float32), torch.tensor(format_edges(), dtype=torch.float32)])
    x = x[(x != 0) & torch.isfinite(x)]
    assert_headroom_matches_casts({"x": x})


def test_the_binade_below_the_smallest_subnormal_rounds_up_not_to_zero():
    # 3e-8 lies in [2**-25, 2**-24): float16 stores it as its smallest subnormal, not as zero.
    x = torch.tensor([3e-8, 4e-8, 5.9e-8])
    assert (x.to(torch.float16) == torch.finfo(torch.float16).smallest_normal * 2.0 ** -10).all()
    h = by_format(nanscan.scan({"x": x})["x"].exp_hist)["float16"]
    assert (h.subnormal, h.underflow) == (1.0, 0.0)


def test_float8_e4m3fn_overflow_is_nan_or_saturation_never_inf():
    # The format has no infinity; which of the two a cast gives depends on the torch release (module docstring).
    big = torch.tensor([500.0, -1e4, 3e38]).to(torch.float8_e4m3fn).to(torch.float32)
    assert not torch.isinf(big).any()
    assert torch.isnan(big).all() or (big.abs() == 448).all(), big
    assert torch.isnan(torch.tensor([float("nan")]).to(torch.float8_e4m3fn).to(torch.float32)).all()


# -- saturating casts (float8) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, top", [("float8_e4m3fn", 8), ("float8_e5m2", 15)])
def test_saturated_share_is_bounded_by_the_top_binade(fmt, top):
    above = by_format(hist_of(top + 1, count=3) + hist_of(0))[fmt]
    assert (above.saturated, above.saturated_at_most) == (0.75, 0.75)
    straddling = by_format(hist_of(top))[fmt]  # holds the largest finite value: some of it may be beyond
    assert (straddling.saturated, straddling.saturated_at_most) == (0.0, 1.0)
    below = by_format(hist_of(top - 1))[fmt]
    assert (below.saturated, below.saturated_at_most) == (0.0, 0.0)


def test_absmax_resolves_the_top_binade():
    hist = hist_of(8, count=2) + hist_of(0, count=2)  # e4m3fn's top binade [256, 512) holds 448
    under = {h.format: h for h in nanscan.headroom(hist, absmax=300.0)}["float8_e4m3fn"]
    assert (under.saturated, under.saturated_at_most) == (0.0, 0.0)
    at = {h.format: h for h in nanscan.headroom(hist, absmax=448.0)}["float8_e4m3fn"]
    assert (at.saturated, at.saturated_at_most) == (0.25, 0.5)


def test_only_the_float8_formats_report_saturation():
    result = by_format(hist_of(20))
    assert result["float16"].saturated is None and result["bfloat16"].saturated_at_most is None
    assert result["float8_e5m2"].to_dict()["saturated"] == 1.0


@pytest.mark.parametrize("fmt, smallest_subnormal", [("float8_e4m3fn", -9), ("float8_e5m2", -16), ("float16", -24)])
def test_below_smallest_subnormal_counts_what_rounds_up_to_it_and_what_flushes(fmt, smallest_subnormal):
    h = by_format(hist_of(smallest_subnormal - 1) + hist_of(smallest_subnormal - 2) + hist_of(smallest_subnormal))[fmt]
    assert h.below_smallest_subnormal == 2 / 3
    assert h.underflow == 1 / 3  # of those, the binade below the one that rounds up: zero after a cast


@pytest.mark.parametrize("log2_scale", [-14, -8, 0, 6, 9, 14, 17])
def test_saturating_cast_shares_against_the_data(log2_scale):
    gen = torch.Generator().manual_seed(log2_scale + 77)
    x = (torch.randn(50_000, generator=gen, dtype=torch.float64) * 2.0 ** log2_scale).to(torch.float32)
    x = torch.cat([x, torch.tensor([448.0, -57344.0, 2.0 ** -9, 2.0 ** -16]) * 2.0 ** (log2_scale // 8)])
    x = x[x != 0]
    stats = nanscan.scan({"x": x})["x"]
    formats = {f.name: f for f in FORMATS}
    for h in nanscan.headroom(stats.exp_hist, absmax=stats.absmax):
        fmt = formats[h.format]
        assert h.below_smallest_subnormal == float((x.abs() < 2.0 ** fmt.min_subnormal_binade).double().mean())
        if fmt.max_finite is not None:
            beyond = float((x.abs() >= fmt.max_finite).double().mean())
            assert h.saturated <= beyond <= h.saturated_at_most, (h, beyond)
            # A saturating cast (clamp, then cast) pins those values, and the ones rounding up to the largest
            # finite, all of them in the top binade or above.
            cast = x.clamp(-fmt.max_finite, fmt.max_finite).to(getattr(torch, h.format)).float()
            pinned = float((cast.abs() == fmt.max_finite).double().mean())
            assert beyond <= pinned <= by_format(stats.exp_hist)[h.format].saturated_at_most
