"""The run's precision in replay (NOTE: [replayed precision] in nanscan/runtime/rerun_inputs.py): a bfloat16-autocast run is
replayed, ablated, exported and rehearsed in bfloat16 through an entry that has no autocast of its own; an entry
that declares its own (ReplaySpec.autocast="entry") is left alone; the precision ablation rows apply whether or not
the run autocast, and where the entry's own region overrides one, the row says so.

The planted fault needs bfloat16: a weight of 1 times 1 + 2**-12 is 1 once rounded to bfloat16 (8 bits of
mantissa), so the loss log(out - 1) is log(0) = -inf there, and finite in float32.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from nanscan.bundle import load_bundle
from nanscan.entry import EntryError, ReplaySpec, build_spec, replay_entry
from nanscan.preflight import run_preflight
from nanscan.replay import StepOptions, export_regression, replay
from nanscan.replay.ablate import ablate
from nanscan.replay.step import recorded_precision, with_run_precision
from nanscan.runtime.monitor import Monitor, NonFiniteError

MODULE = Path(__file__).stem
FAULT_STEP = 3
# the dtype of the model's output in each forward, as the entries' step functions saw it
SEEN: list[torch.dtype] = []


def precision_batch(config: dict, step: int) -> dict:
    """1.25 (exact in every precision) but at the fault step: 1 + 2**-12 (1 in bfloat16 and float16), or with
    config["fault"] == "any", exactly 1 (log(0) in every precision)."""
    value = 1.25
    if step == config.get("fault_step", FAULT_STEP):
        value = 1.0 if config.get("fault") == "any" else 1.0 + 2.0 ** -12
    return {"x": torch.full((4, 1), value)}


def _model() -> nn.Module:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def log_gap_step(model, batch):
    out = model(batch["x"])
    SEEN.append(out.dtype)
    return torch.log(out.float() - 1.0).mean()


def _spec(autocast: str = "replay", step_fn=log_gap_step) -> ReplaySpec:
    healthy = [precision_batch({"fault_step": -1}, step) for step in range(2)]
    # lr 0: the weight stays exactly 1, so only the precision decides the fault
    return ReplaySpec(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.0), step_fn, healthy,
                      autocast=autocast)


@replay_entry
def plain(config: dict) -> ReplaySpec:
    """No autocast in step_fn: the replay enters the run's."""
    return _spec()


@replay_entry
def own_none(config: dict) -> ReplaySpec:
    """Declares its own autocast, and enters none: float32, whatever the run recorded."""
    return _spec("entry")


def _own_bf16_step(model, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return log_gap_step(model, batch)


@replay_entry
def own_bf16(config: dict) -> ReplaySpec:
    """Declares its own autocast, and enters bfloat16 in step_fn, as the loop did."""
    return _spec("entry", _own_bf16_step)


def train(bundle_dir: Path, *, autocast: bool = True, fault: str = "bf16") -> Path:
    """The loop enters bfloat16 autocast around the forward (or none), as nanoGPT's `ctx` does; returns the
    bundle's path."""
    config = {"fault": fault}
    spec = build_spec(f"{MODULE}:plain", config)
    optimizer = spec.make_optimizer()
    monitor = Monitor(spec.model, optimizer, bundle_dir=bundle_dir, run_id="precision", config=config,
                      replay_entry=f"{MODULE}:plain", snapshot="cpu", spikes=None)
    for step in range(FAULT_STEP + 2):
        batch = precision_batch(config, step)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = spec.step_fn(spec.model, batch)
        loss.backward()
        try:
            monitor.check(batch=batch, loss=loss, step=step)
        except NonFiniteError as exc:
            return Path(exc.bundle_path)
        optimizer.step()
    raise AssertionError("the run stayed finite")


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory) -> Path:
    path = train(tmp_path_factory.mktemp("bf16"))
    bundle = load_bundle(path)
    assert (bundle.step, bundle.category) == (FAULT_STEP, "loss")
    assert bundle.manifest["mixed_precision"]["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    return path


def test_an_entry_without_autocast_is_replayed_in_the_runs_bfloat16(bf16_bundle):
    SEEN.clear()
    result = replay(bf16_bundle, f"{MODULE}:plain", bisect=False)
    assert result.reproduced and result.verdict == "persistent"
    assert all(run.autocast == "bfloat16" for run in result.runs)
    assert SEEN and set(SEEN) == {torch.bfloat16}  # the Linear's output: computed in bfloat16
    assert result.op is not None and result.op.op == "aten.log"
    assert "precision: the run's bfloat16 autocast is re-applied around step_fn" in result.notes


def test_an_entry_that_declares_its_own_autocast_is_left_alone(bf16_bundle):
    SEEN.clear()
    result = replay(bf16_bundle, f"{MODULE}:own_none", bisect=False)
    assert not result.reproduced  # float32, as the entry runs it: the bfloat16 rounding is not there
    assert all(run.autocast is None for run in result.runs) and set(SEEN) == {torch.float32}
    assert any("is not re-applied: the replay entry enters its own (ReplaySpec.autocast='entry')" in note
               for note in result.notes)
    SEEN.clear()
    own = replay(bf16_bundle, f"{MODULE}:own_bf16", bisect=False)
    assert own.reproduced and all(run.autocast == "bfloat16" for run in own.runs) and set(SEEN) == {torch.bfloat16}


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-run", "fp32-run"])
def test_the_precision_rows_are_applied_whether_or_not_the_run_autocast(autocast, tmp_path):
    path = train(tmp_path, autocast=autocast, fault="any")
    result = ablate(path, f"{MODULE}:plain", factors=["fp32", "bf16-autocast", "fp16-autocast"], holdout=0)
    assert result.baseline.outcome.autocast == ("bfloat16" if autocast else None)
    for key, dtype in (("fp32", None), ("bf16-autocast", "bfloat16"), ("fp16-autocast", "float16")):
        row = result.row(key)
        assert row.applied and row.outcome.autocast == dtype, (key, row.note)


def test_a_precision_factor_replaces_the_runs_autocast(bf16_bundle):
    result = ablate(bf16_bundle, f"{MODULE}:plain", factors=["fp32", "bf16-autocast", "fp16-autocast"], holdout=0)
    assert not result.baseline.outcome.finite and result.baseline.outcome.autocast == "bfloat16"
    fp32 = result.row("fp32")
    assert fp32.applied and fp32.outcome.finite and fp32.fixes and fp32.outcome.autocast is None
    for key in ("bf16-autocast", "fp16-autocast"):  # 1 + 2**-12 rounds to 1 in both
        assert result.row(key).applied and not result.row(key).outcome.finite


def test_a_precision_row_the_entrys_own_autocast_overrides_is_not_applied_and_says_why(bf16_bundle):
    result = ablate(bf16_bundle, f"{MODULE}:own_bf16", factors=["fp32", "bf16-autocast"], holdout=0)
    assert result.baseline.outcome.autocast == "bfloat16" and not result.baseline.outcome.finite
    fp32 = result.row("fp32")
    assert not fp32.applied and not fp32.fixes
    assert "the replay entry enters its own autocast (bfloat16; ReplaySpec.autocast='entry')" in fp32.note
    assert result.row("bf16-autocast").applied  # the entry's own region is the factor's


def _generated_test(result):
    spec = importlib.util.spec_from_file_location(Path(result.test_file).stem, result.test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(getattr(module, name) for name in dir(module) if name.startswith("test_"))


def test_an_exported_test_runs_in_the_runs_precision_unless_the_entry_enters_its_own(bf16_bundle, tmp_path):
    result = export_regression(bf16_bundle, tmp_path / "plain", f"{MODULE}:plain")
    assert result.reproduced
    assert "options=with_run_precision(spec, StepOptions(), case.meta[\"autocast\"])" in \
        Path(result.test_file).read_text()
    with pytest.raises(AssertionError, match=r"non-finite \(loss\)"):
        _generated_test(result)()  # fails in bfloat16, as the run did
    own = export_regression(bf16_bundle, tmp_path / "own", f"{MODULE}:own_none")
    assert not own.reproduced
    _generated_test(own)()  # the entry's own precision (float32) is finite: the test passes


def test_preflight_rehearses_in_the_precision_it_is_given():
    SEEN.clear()
    report = run_preflight(plain({}), steps=2, precision="bfloat16")
    assert report.go, report.reasons
    assert set(SEEN) == {torch.bfloat16}
    SEEN.clear()
    run_preflight(own_none({}), steps=2, precision="bfloat16")
    assert set(SEEN) == {torch.float32}
    with pytest.raises(ValueError, match="precision='fp8'"):
        run_preflight(plain({}), precision="fp8")


def test_the_recorded_region_maps_to_a_precision():
    assert recorded_precision({"device_type": "cuda", "dtype": "bfloat16"}) == "bfloat16"
    assert recorded_precision({"device_type": "cuda", "dtype": "float16", "enabled": False}) is None
    assert recorded_precision(None) is None and recorded_precision({"dtype": "float8_e4m3fn"}) is None
    region = {"device_type": "cpu", "dtype": "float16"}
    assert with_run_precision(plain({}), StepOptions(), region).precision == "float16"
    assert with_run_precision(plain({}), StepOptions(precision="float32"), region).precision == "float32"
    assert with_run_precision(own_none({}), StepOptions(), region).precision is None
    with pytest.raises(EntryError, match="autocast='yes'"):
        ReplaySpec(nn.Linear(1, 1), None, log_gap_step, autocast="yes")
