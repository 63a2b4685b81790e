"""A rerun against its recorded step, bit for bit (nanscan.engine.fingerprint NOTE: [bit-exact rerun]): replay says
"bit for bit" when its reruns give the recorded fingerprints, and names the first tensor that differs when the
record was altered after the fact (a finite mantissa bit flipped in one gradient between backward and the check:
what no NaN check sees), with what its deterministic and nondeterministic reruns measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nanscan import Monitor, NonFiniteError
from nanscan.engine.fingerprint import BITS, compare_scans
from nanscan.entry import ReplaySpec, replay_entry
from nanscan.replay import record_replay, replay
from nanscan.scan import scan

ENTRY = f"{Path(__file__).stem}:entry"
FAULT_STEP = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def step_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


@replay_entry
def entry(config: dict) -> ReplaySpec:
    return ReplaySpec(model=make_model(), optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                      step_fn=step_loss)


def run(tmp_path: Path, *, flip: bool) -> Path:
    """Steps with a NaN at FAULT_STEP in a batch tensor the model never reads (the gradients stay finite); with
    `flip`, the loop flips one mantissa bit of one gradient before that step's check."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, bundle_dir=tmp_path, run_id="flip" if flip else "clean", replay_entry=ENTRY,
                  snapshot="cpu")  # exact conditions: the pre-step state and RNG
    with pytest.raises(NonFiniteError) as caught:
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g),
                     "aux": torch.randn(8, generator=g)}
            if step == FAULT_STEP:
                batch["aux"][2] = float("nan")
            opt.zero_grad(set_to_none=True)
            step_loss(model, batch).backward()
            if flip and step == FAULT_STEP:
                grad = model[2].weight.grad
                grad.view(torch.int32)[0, 3] ^= 1 << 4  # a mantissa bit: still finite
            mon.check(batch=batch, loss=step_loss(model, batch).detach())
            opt.step()
    assert caught.value.step == FAULT_STEP
    return Path(caught.value.bundle_path)


def test_a_rerun_that_matches_the_record_says_bit_for_bit(tmp_path):
    result = replay(run(tmp_path, flip=False), bisect=False)
    assert result.reproduced and result.bitwise["equal"]
    assert result.bitwise["compared"] >= 10  # inputs, weights, Adam's state, gradients
    assert "bit for bit" in result.headline()


def test_a_gradient_altered_after_the_fact_is_named_with_what_the_reruns_measured(tmp_path):
    bundle = run(tmp_path, flip=True)
    result = replay(bundle, bisect=False)
    assert result.reproduced  # the NaN in the batch comes back: only the altered gradient differs
    bitwise = result.bitwise
    assert not bitwise["equal"] and bitwise["differences"] == 1
    assert bitwise["first_difference"] == {"name": "grad:2.weight", "what": BITS, "detail": "finite in both",
                                           "finite_in_both": True}
    assert bitwise["reruns_agree"] and bitwise["nondeterministic_rerun_agrees"]
    assert bitwise["points_at"] == "code outside the rerun, or the hardware"
    assert "the rerun first differs at grad:2.weight (finite in both)" in result.headline()
    record_replay(result)
    text = (bundle / "INCIDENT.md").read_text()
    assert "the kernels' nondeterminism does not explain the difference" in text


def test_compare_scans_names_what_differs():
    a = {"grad:w": torch.ones(4), "grad:b": torch.zeros(2)}
    b = {"grad:w": torch.ones(4), "grad:b": torch.tensor([0.0, float("nan")])}
    result = compare_scans(scan(a).stats, scan(b).stats)
    assert (result.compared, result.first_difference.name, result.first_difference.finite_in_both) == \
        (2, "grad:b", False)
    assert compare_scans(scan(a).stats, scan(a).stats, kinds=("grad:",)).equal
