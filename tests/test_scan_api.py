"""The public scan API through the default backend selection (`backend=None`), so that the suite's second run,
with NANSCAN_BACKEND=numba, drives the numba backend through exactly the calls users make.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import nanscan
from nanscan.engine import backends
from nanscan.engine.inputs import prepare


@pytest.fixture
def bundle_dir(tmp_path, monkeypatch):
    """nanscan.check writes an evidence bundle at the first non-finite step: keep it in the test's directory."""
    monkeypatch.setenv("NANSCAN_BUNDLE_DIR", str(tmp_path / "bundles"))
    return tmp_path / "bundles"


def test_default_selection_uses_the_expected_backend_and_agrees_with_the_reference(expected_default_backend,
                                                                                   records_match):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{dtype}": torch.randn(30_001, generator=gen).to(dtype) * 1e-3
               for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    tensors["with specials"] = torch.tensor([0.0, -0.0, 1e-40, float("nan"), float("inf"), -1.5, float("-inf")])
    report = nanscan.scan(tensors)
    assert report.backend == expected_default_backend
    reference = nanscan.scan(tensors, backend="reference")
    records_match(report.records, reference.records, report.names, label=f"default ({report.backend})")


# -- names ----------------------------------------------------------------------------------------------------------

def test_names_of_a_list_a_dict_pairs_a_tensor_and_a_module():
    a, b = torch.ones(2), torch.zeros(3)
    assert nanscan.scan([a, b]).names == ["tensor[0]", "tensor[1]"]
    assert nanscan.scan({"alpha": a, "beta": b}).names == ["alpha", "beta"]
    assert nanscan.scan([("first", a), ("second", b)]).names == ["first", "second"]
    assert nanscan.scan(a).names == ["tensor"]
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    report = nanscan.scan(model)
    assert report.names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var"]
    assert report.skipped == ["1.num_batches_tracked"]  # an int64 buffer


def test_integer_and_bool_tensors_are_skipped_not_scanned():
    report = nanscan.scan({"ids": torch.arange(5), "mask": torch.ones(3, dtype=torch.bool),
                           "x": torch.ones(2), "bytes": torch.zeros(4, dtype=torch.uint8)})
    assert report.names == ["x"]
    assert report.skipped == ["ids", "mask", "bytes"]
    assert "ids" not in report and "x" in report
    assert report.ok


def test_a_non_tensor_is_rejected_with_its_name():
    with pytest.raises(nanscan.UnsupportedTensorError, match="'lr' is a float"):
        nanscan.scan({"lr": 0.1})


# -- what a report says ---------------------------------------------------------------------------------------------

def test_ok_nonfinite_totals_and_lookup_by_name():
    tensors = [torch.tensor([1.0, -2.0, 0.0]),
               torch.tensor([float("nan"), 4.0], dtype=torch.float64),
               torch.tensor([float("-inf"), float("inf"), 0.5], dtype=torch.bfloat16)]
    report = nanscan.scan(tensors)
    assert not report.ok
    assert report.nonfinite == ["tensor[1]", "tensor[2]"]
    assert len(report) == 3
    t = report.totals
    assert (t.tensors, t.numel, t.nan, t.posinf, t.neginf, t.zero) == (3, 8, 1, 1, 1, 1)
    assert t.finite == 5
    assert t.absmax == 4.0
    assert t.sumsq == pytest.approx(1 + 4 + 16 + 0.25)
    assert t.exp_hist.sum() == 4  # finite non-zero values: 1, -2, 4, 0.5
    assert report["tensor[2]"].posinf == 1 and report["tensor[2]"].neginf == 1
    assert report["tensor[0]"].ok and not report["tensor[1]"].ok
    with pytest.raises(KeyError, match="no tensor named 'tensor\\[9\\]'"):
        report["tensor[9]"]
    assert nanscan.scan([torch.ones(4)]).ok and nanscan.scan([torch.ones(4)]).nonfinite == []


def test_absmax_and_absmin_skip_non_finite_values():
    report = nanscan.scan({"mixed": torch.tensor([float("nan"), float("inf"), float("-inf"), 3.0, -7.0, 0.0]),
                           "only non-finite": torch.tensor([float("nan"), float("-inf")], dtype=torch.float16)})
    mixed = report["mixed"]
    assert (mixed.absmax, mixed.absmin) == (7.0, 3.0)
    assert mixed.sumsq == 58.0
    bad = report["only non-finite"]
    assert (bad.absmax, bad.absmin, bad.sumsq) == (0.0, 0.0, 0.0)
    for stats in report:
        assert math.isfinite(stats.absmax) and math.isfinite(stats.absmin) and math.isfinite(stats.sumsq)
    json.dumps(report.to_dict(), allow_nan=False)  # a report is plain JSON, never NaN or Infinity


def test_an_all_zero_tensor():
    stats = nanscan.scan({"z": torch.zeros(1000, dtype=torch.float64)})["z"]
    assert (stats.zero, stats.absmin, stats.absmax, stats.sumsq, stats.subnormal) == (1000, 0.0, 0.0, 0.0, 0)
    assert stats.exp_hist.sum() == 0 and stats.ok


@pytest.mark.parametrize("backend", ["reference", "cpu", "numba"])
def test_flush_to_zero_mode_changes_no_record(backend):
    """torch.set_flush_denormal(True) (common in CPU inference) makes float ops read subnormals as zeros; no
    host backend may count, bin or square them so, and each leaves the caller's mode as it was."""
    try:
        backends.load(backend)
    except backends.BackendUnavailable as exc:
        pytest.skip(f"{backend} backend not available here: {exc}")
    tensors = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tiny = torch.finfo(dtype).tiny  # made before the mode is set: arithmetic on subnormals is what it changes
        tensors[f"mixed {dtype}"] = (torch.tensor([0.25, -0.5, 1.0, 0.0], dtype=torch.float64) * tiny).to(dtype)
        tensors[f"only subnormals {dtype}"] = (torch.tensor([0.5, -0.25], dtype=torch.float64) * tiny).to(dtype)
    plain = nanscan.scan(tensors, backend=backend)
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals; the test needs one that can"
    try:
        flushed = nanscan.scan(tensors, backend=backend)
        mode_kept = bool((torch.ones(1, dtype=torch.int64).view(torch.float64) * 1.0).item() == 0.0)
    finally:
        torch.set_flush_denormal(False)
    assert mode_kept, f"the {backend} backend turned the caller's flush-to-zero mode off"
    for name in tensors:
        assert flushed[name].subnormal == plain[name].subnormal == 2, name
    assert (flushed.records == plain.records).all()


def test_finite_is_numel_minus_nan_and_infinities():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=gen)
    x[::7] = float("nan")
    x[::11] = float("inf")
    x[::13] = float("-inf")
    x[::17] = 0.0
    stats = nanscan.scan({"x": x})["x"]
    assert stats.finite == stats.numel - stats.nan - stats.posinf - stats.neginf
    assert stats.finite == int(torch.isfinite(x).sum())
    assert (stats.nan, stats.posinf, stats.neginf) == (int(x.isnan().sum()), int(x.isposinf().sum()),
                                                       int(x.isneginf().sum()))
    assert stats.zero + stats.exp_hist.sum() == stats.finite  # every finite value is a zero or in one bin


def test_complex_tensors_are_scanned_as_real_and_imaginary_parts():
    z = torch.tensor([1 + 2j, complex(3, float("nan"))], dtype=torch.complex64)
    stats = nanscan.scan({"z": z})["z"]
    assert (stats.dtype, stats.numel, stats.nan, stats.absmax) == ("complex64", 4, 1, 3.0)


def test_lazily_conjugated_and_negated_views_are_read_by_their_values():
    """z.conj() and z.conj().imag are views whose sign lives in a flag, not in memory: the imaginary +inf below is
    -inf in both, and view_as_real refuses a conjugated tensor outright."""
    z = torch.tensor([complex(1.0, float("inf")), complex(float("nan"), 2.0)], dtype=torch.complex64)
    conj, imag = z.conj(), z.conj().imag
    assert conj.is_conj() and imag.is_neg()
    report = nanscan.scan({"conj": conj, "imag": imag})
    for name, materialized in {"conj": conj.resolve_conj(), "imag": torch.tensor([float("-inf"), -2.0])}.items():
        expected = nanscan.scan({name: materialized})
        assert np.array_equal(report.records[report.names.index(name)], expected.records[0]), name
    assert (report["conj"].nan, report["conj"].posinf, report["conj"].neginf) == (1, 0, 1)
    assert (report["imag"].posinf, report["imag"].neginf, report["imag"].dtype) == (0, 1, "float32")


def test_numpy_arrays_are_scanned_as_tensors():
    values = np.array([[1.0, np.nan, -4.0], [np.inf, 0.0, 2.0]])
    report = nanscan.scan(values)
    assert report.names == ["tensor"] and report["tensor"].numel == 6
    columns = nanscan.scan({"strided": values[:, ::2], "half": values.astype(np.float16), "ids": np.arange(3)})
    assert (columns["strided"].nan, columns["strided"].posinf, columns["strided"].absmax) == (0, 1, 4.0)
    assert columns["half"].dtype == "float16" and columns["half"].nan == 1
    assert columns.skipped == ["ids"]
    with pytest.raises(nanscan.UnsupportedTensorError, match="'wide' is a numpy array of dtype object"):
        nanscan.scan({"wide": np.array([1.0, None])})


# -- what cannot be scanned ------------------------------------------------------------------------------------------

def test_an_uninitialized_lazy_parameter_raises_naming_it():
    with pytest.raises(nanscan.UnsupportedTensorError, match="'weight' is an uninitialized parameter.*forward"):
        nanscan.scan(torch.nn.LazyLinear(3))

def test_a_meta_tensor_raises_naming_it():
    with pytest.raises(nanscan.UnsupportedTensorError, match="'encoder.weight' is a meta tensor"):
        nanscan.scan({"encoder.weight": torch.empty(4, 4, device="meta")})
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(nanscan.UnsupportedTensorError, match="'weight' is a meta tensor.*materialize"):
        nanscan.scan(model)


def test_an_unsupported_floating_dtype_raises_with_what_to_do():
    # float8_e8m0fnu (exponent only: the scales of MX formats) is the one float8 format nanscan does not scan.
    x = torch.ones(3).to(torch.float8_e8m0fnu)
    with pytest.raises(nanscan.UnsupportedTensorError, match="'act' has dtype float8_e8m0fnu.*t.float"):
        nanscan.scan({"act": x})


def test_sparse_coo_tensors_are_scanned_by_their_values():
    indices = torch.tensor([[0, 2, 2], [1, 0, 3]])
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([1.0, float("nan"), -5.0]), (1000, 1000),
                                     check_invariants=True)
    stats = nanscan.scan({"g": sparse})["g"]
    assert (stats.numel, stats.nan, stats.absmax, stats.zero) == (3, 1, 5.0, 0)  # not 10**6 elements


# -- no copies ------------------------------------------------------------------------------------------------------

def test_dense_layouts_are_read_in_place():
    x = torch.randn(6, 8, 5, 3)
    for name, t in {"contiguous": x, "transposed": x[0, 0].t(), "permuted": x.permute(2, 0, 3, 1),
                    "channels_last": x.contiguous(memory_format=torch.channels_last)}.items():
        item = prepare(name, t)
        assert not item.copied, name
        assert item.flat.data_ptr() == t.data_ptr(), name
        assert item.numel == t.numel()


def test_views_with_gaps_are_compacted_and_still_counted_right():
    x = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    x[0, 0] = float("nan")
    sliced = x[::2, ::3]
    item = prepare("sliced", sliced)
    assert item.copied and item.numel == sliced.numel()
    stats = nanscan.scan({"sliced": sliced, "expanded": x[1:2].expand(4, 10)})
    assert stats["sliced"].nan == 1 and stats["sliced"].numel == 12
    assert stats["expanded"].numel == 40 and stats["expanded"].absmax == 19.0


# -- check(model, optimizer) ----------------------------------------------------------------------------------------

def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def train_step(model, optimizer):
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(8, 3)).pow(2).mean().backward()
    optimizer.step()


def test_check_names_params_grads_and_optimizer_state(bundle_dir, expected_default_backend):
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    report = nanscan.check(model, optimizer)
    assert report.names == ["param:0.weight", "param:0.bias", "param:2.weight", "param:2.bias"]  # no grads yet
    train_step(model, optimizer)
    model(torch.randn(8, 3)).sum().backward()
    report = nanscan.check(model, optimizer)
    assert report.backend == expected_default_backend
    for name in ("param:0.weight", "grad:0.weight", "grad:2.bias", "optim:0.weight.exp_avg",
                 "optim:0.weight.exp_avg_sq", "optim:2.bias.exp_avg"):
        assert name in report, name
    assert report["optim:0.weight.exp_avg"].numel == 12
    assert report.ok and not bundle_dir.exists()


def test_check_skips_parameters_without_gradients(bundle_dir):
    model = tiny_model()
    model[0].weight.requires_grad_(False)
    model(torch.randn(2, 3)).sum().backward()
    names = nanscan.check(model).names
    assert "grad:0.bias" in names and "grad:0.weight" not in names


def test_check_sparse_gradients(bundle_dir):
    model = torch.nn.Embedding(1000, 4, sparse=True)
    model(torch.tensor([3, 7, 7])).sum().backward()
    assert model.weight.grad.is_sparse
    report = nanscan.check(model)
    grad = report["grad:weight"]
    assert (grad.numel, grad.absmax, grad.absmin) == (2 * 4, 2.0, 1.0)  # rows 3 and 7 (twice), not 1000 x 4


def test_check_counts_steps_and_remembers_the_first_invalid_one(bundle_dir):
    model = tiny_model()
    assert nanscan.first_invalid(model) is None
    assert [nanscan.check(model).step for _ in range(3)] == [0, 1, 2]
    assert nanscan.first_invalid(model) is None
    with torch.no_grad():
        model[2].bias.fill_(float("nan"))
    with pytest.warns(nanscan.NonFiniteWarning):
        report = nanscan.check(model)
    assert report.step == 3 and not report.ok
    assert report.nonfinite == ["param:2.bias"]
    assert nanscan.first_invalid(model) == 3
    assert nanscan.check(model, step=10).step == 10
    assert nanscan.check(model).step == 11
    assert nanscan.first_invalid(model) == 3  # the first one stays
    assert nanscan.first_invalid(tiny_model()) is None  # per model
