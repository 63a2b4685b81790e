"""Integer batches at an incident (NOTE: [no supervised tokens] in nanscan/engine/targets.py): targets that are all
the ignore index are named as the cause of the non-finite loss, by the same rule `nanscan data` applies to a
record's labels: -100 in the incident note and replay, and the loss's own ignore index (nanoGPT's -1) in replay,
from the negative log-likelihood op it finds."""

from __future__ import annotations

import numpy as np
import torch

import nanogpt_runs as G
import real_failures as R
from nanscan.bundle import load_bundle
from nanscan.data.findings import DEFAULT_IGNORE_INDEX
from nanscan.engine.targets import all_ignored, ignored_targets
from nanscan.incident import explain_category
from nanscan.replay import record_replay, replay
from nanscan.runtime.monitor import Monitor, NonFiniteError

LABELS_CAUSE = ("every target of the batch (`labels`, 48 value(s)) is -100, the ignore index: a mean cross-entropy "
                "over no tokens is 0/0")


def test_the_rule_on_a_batchs_tensors():
    labels = torch.full((2, 3), -100)
    batch = {"tokens": torch.ones(2, 3, dtype=torch.long), "labels": labels, "mask": torch.zeros(2, 3, dtype=bool),
             "weights": torch.full((2,), -100.0)}
    [found] = ignored_targets(batch)
    assert (found.path, found.count, found.ignore_index) == ("labels", 6, -100)
    assert ignored_targets({"y": torch.full((4,), -1)}) == []  # -1 only when the loss says so
    [found] = ignored_targets((torch.zeros(4, dtype=torch.long), torch.full((4,), -1)), None)
    assert (found.path, found.ignore_index) == ("1", -1)
    partly = labels.clone()
    partly[1, 2] = 7
    assert ignored_targets({"labels": partly}) == [] and ignored_targets({"labels": partly}, None) == []
    assert ignored_targets({"labels": torch.zeros(0, dtype=torch.long)}) == []
    # the data check's constant and rule are these
    assert DEFAULT_IGNORE_INDEX == -100 and all_ignored(np.array([-100, -100]), -100)
    assert not all_ignored([], -100) and not all_ignored([-100, 3], -100)


def test_labels_all_ignored_are_the_cause_in_the_incident_note_and_the_replay(tmp_path):
    path = R.train("all_labels_ignored", tmp_path)
    bundle = load_bundle(path)
    text = bundle.incident_text()
    assert f"Likely cause: {LABELS_CAUSE}." in text
    assert "nothing in it can be NaN" not in text
    detect = next(f for f in bundle.findings() if f["key"] == "detect")
    assert detect["record"]["ignored_targets"] == [{"path": "labels", "count": 48, "ignore_index": -100}]
    result = replay(path)
    assert result.reproduced and result.op.op == "aten.nll_loss_forward"
    assert result.cause["text"] == LABELS_CAUSE and result.to_dict()["cause"]["ignore_index"] == -100
    assert "; cause: every target of the batch is -100, the ignore index" in result.headline()
    assert result.explanation().startswith(f"Cause: {LABELS_CAUSE}.")
    record_replay(result)
    assert f"Cause: {LABELS_CAUSE}." in load_bundle(path).incident_text()


def test_a_healthy_integer_batch_names_no_cause(tmp_path):
    path = R.train("zero_token_count", tmp_path)  # labels clamped to 0: nothing is the ignore index
    assert "Likely cause" not in load_bundle(path).incident_text()
    assert replay(path, bisect=False).cause is None


def nanogpt_ignored_run(tmp_path, fault_at: int = 2):
    """nanoGPT's loop (bf16 autocast, two micro-batches, a check after each) whose micro-batch 0 at iteration
    `fault_at` has every target -1, the ignore index its model's cross_entropy is given."""
    c = G.full_config({})
    model = G.build_model(c)
    optimizer = G.configure_optimizer(model, c)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="nanogpt", config={}, replay_entry=G.ENTRY,
                      spikes=None)
    for it in range(fault_at + 1):
        for micro in range(c["accum"]):
            batch = G.get_batch(c, it, micro)
            if (it, micro) == (fault_at, 0):
                batch["y"][:] = -1  # every window masked out
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch["x"], batch["y"])[1] / c["accum"]
            loss.backward()
            try:
                monitor.check(batch=batch, loss=loss, micro_batch=micro < c["accum"] - 1)
            except NonFiniteError as exc:
                return exc
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    raise AssertionError("the run stayed finite")


def test_nanogpts_ignore_index_minus_one_is_named_from_the_loss_replay_finds(tmp_path):
    error = nanogpt_ignored_run(tmp_path)
    bundle = load_bundle(error.bundle_path)
    assert (bundle.step, bundle.category, bundle.manifest["micro_batch"]) == (2, "loss", 0)
    # the incident knows only torch's default ignore index: it does not clear the integer batch either
    assert "targets that are all the loss's ignore index would still make a mean loss 0/0" in bundle.incident_text()
    result = replay(error.bundle_path, bisect=False)
    assert result.reproduced and result.op.op == "aten.nll_loss_forward"
    assert all(run.autocast == "bfloat16" for run in result.runs)  # the run's autocast, re-applied
    size = G.BASE["batch_size"] * G.BASE["block_size"]
    assert result.cause["text"] == (f"every target of micro-batch 0 (`y`, {size} value(s)) is -1, the ignore index: "
                                    "a mean cross-entropy over no tokens is 0/0")
    assert "cause: every target of micro-batch 0 is -1, the ignore index" in result.headline()


def test_a_named_cause_replaces_the_sentence_on_integer_batches():
    generic = explain_category("loss", inputs_checked=False, batch_given=True)
    assert "none of them can be NaN, but targets that are all the loss's ignore index" in generic
    named = explain_category("loss", inputs_checked=False, batch_given=True, batch_cause=LABELS_CAUSE)
    assert named.endswith(f" Likely cause: {LABELS_CAUSE}.") and "none of them can be NaN" not in named
