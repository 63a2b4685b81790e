"""on_invalid=Resume(directory) (nanscan.runtime.resume NOTE: [resume elsewhere]; issue 62 item 6): karpathy's train.py
loop at learning rate 30 stops at its NaN with ResumeExit (a SystemExit whose code a launcher reads), its message
naming the bundle and the checkpoint; the checkpoint is the newest state the window kept from before the episode's
first warning, loaded by plain DCP into a fresh model and optimizer bit for bit, and it trains on from there at a
lower rate; written again, the same files. On 2 gloo ranks under DDP and FSDP2 every rank exits with the same code
and one checkpoint of the whole state is written. Bad settings are refused by name."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

import karpathy_train as K
from nanscan import Monitor, Resume, ResumeExit, load_bundle
from nanscan.bundle.checkpoint import RESUME_FILE
from nanscan.runtime.resume import RESUME_EXIT_CODE, resume_state_step, write_resume_checkpoint
from nanscan.runtime.spikes import episode_start
from nanscan.runtime.window import Window
from spawn_ranks import gloo_rank, spawn, write_result

pytestmark = pytest.mark.filterwarnings("ignore::nanscan.incident.SpikeWarning")
WINDOW = Window(steps=32, every=8)


def _load(path):
    return K.load_checkpoint(path, K.LR30)


def _files(path: Path) -> dict:
    """The checkpoint's files by content, DCP's .metadata left out (it carries an id of its own save)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.name != ".metadata"}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    with pytest.raises(ResumeExit) as caught:
        K.train(K.LR30, root / "bundles", window=WINDOW, on_invalid=Resume(root / "checkpoints"))
    return root, caught.value


def test_the_run_exits_with_the_code_naming_the_bundle_and_the_checkpoint(stopped):
    root, exc = stopped
    assert isinstance(exc, SystemExit) and exc.code == RESUME_EXIT_CODE == 75
    bundle = load_bundle(exc.bundle_path)
    assert str(exc.bundle_path) in str(exc) and str(exc.checkpoint) in str(exc)
    assert exc.checkpoint == root / "checkpoints" / "train-py" / f"step-{exc.step}"
    # the newest kept state at or before the episode's first warning (the fault's damage came after it)
    states = [s["step"] for s in bundle.window["states"]]
    first = episode_start([s["step"] for s in bundle.spikes], bundle.step)
    assert exc.step == resume_state_step(states, first) and exc.step < bundle.step
    resume = json.loads((exc.checkpoint / RESUME_FILE).read_text())
    assert resume["step"] == exc.step and resume["bundle"] == str(exc.bundle_path)
    if exc.step == 0:  # kept before the first update: the model alone, and said
        assert "optimizer" not in resume["keys"] and any("no state yet" in n for n in resume["notes"])


def test_the_checkpoint_is_the_kept_state_and_trains_on(stopped):
    _, exc = stopped
    bundle = load_bundle(exc.bundle_path)
    model, optimizer = _load(exc.checkpoint)
    kept_model, _ = bundle.window_state(exc.step)
    for name, t in model.state_dict().items():
        assert torch.equal(t, kept_model[name]), name
    # the restart: the same data from the kept step on, a tenth of the rate (what the diagnosis would advise)
    c = K.full_config(K.LR30)
    records = [r for r in bundle.window_records() if r.step >= exc.step and r.batch is not None]
    losses = []
    for record in records[:20]:
        for group, lr in zip(optimizer.param_groups, record.lrs):
            group["lr"] = lr * 0.1
        _, loss = model(record.batch["x"], record.batch["y"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses and all(math.isfinite(x) for x in losses), losses


def test_writing_it_again_gives_the_same_files(stopped, tmp_path):
    root, exc = stopped
    before = _files(exc.checkpoint)
    path, step = write_resume_checkpoint(Resume(root / "checkpoints"), exc.bundle_path, "train-py", exc.step)
    assert (path, step) == (exc.checkpoint, exc.step) and _files(path) == before


def test_bad_settings_are_refused_by_name(tmp_path):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Resume.exit_code=0."):
        Resume(tmp_path, exit_code=0)
    with pytest.raises(TypeError, match="Resume.directory=None."):
        Resume(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_invalid=Resume.* keeps no window"):
        Monitor(model, optimizer, bundle_dir=tmp_path, on_invalid=Resume(tmp_path), window=None)


def test_without_a_bundle_no_checkpoint_is_written_and_the_reason_says_why(tmp_path):
    """The incident's bundle could not be written (a full disk): the checkpoint, written from it, cannot be; the
    reason goes into the NonFiniteError the policy raises instead of exiting."""
    with pytest.raises(Exception) as caught:
        write_resume_checkpoint(Resume(tmp_path), None, "run", 0)
    assert "bundle could not be written" in str(caught.value)


def _stopped(out: str, parallel: str) -> dict:
    try:
        K.train(K.LR30, Path(out) / "bundles", parallel=parallel, window=WINDOW,
                on_invalid=Resume(Path(out) / "checkpoints"), run_id=parallel)
    except ResumeExit as exc:
        return {"code": exc.code, "checkpoint": str(exc.checkpoint), "step": exc.step, "message": str(exc),
                "bundle": str(exc.bundle_path)}
    return {"finished": True}


def _worker(rank: int, parallel: str, store: str, out: str) -> None:
    gloo_rank(rank, store, 2)
    write_result(out, rank, lambda: _stopped(out, parallel))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_every_rank_exits_with_the_code_and_one_checkpoint_of_the_whole_state_is_written(tmp_path, parallel):
    """Under DDP and FSDP2 (each rank's kept state its shards, joined by rank 0 from the set): every rank exits with
    the code, and the one checkpoint loads in one process as the set's kept state."""
    spawn(_worker, parallel, 2, tmp_path, timeout_s=240, label=f"train.py under {parallel} with Resume")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all("code" in r for r in results), results
    assert {r["code"] for r in results} == {RESUME_EXIT_CODE}
    assert len({(r["checkpoint"], r["step"]) for r in results}) == 1
    checkpoint = Path(results[0]["checkpoint"])
    model, _ = _load(checkpoint)  # the set's state at the kept step, loaded in one process
    kept, _ = load_bundle(Path(results[0]["bundle"]).parent).window_state(results[0]["step"])
    for name, t in model.state_dict().items():
        assert torch.equal(t, kept[name]), name
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name]
