"""The in-process diagnosis on every rank together (nanscan.runtime.incident_diagnosis NOTE: [in-process diagnosis];
issue 59 item 3): karpathy's train.py loop at learning rate 30 on 2 gloo ranks, as train.py runs under torchrun
(DistributedDataParallel, each rank's own data, gradients synchronized at the last micro-step), under FSDP2
(fully_shard on each block), and on 4 ranks under HSDP (a 2x2 replicate-by-shard mesh) and under tensor
parallelism (each MLP split over a 2-rank "tp" dimension, FSDP2 over "dp"): every rank reruns the window from its own
kept state (its shards, under FSDP2) with its own recorded batches, through the wrapped model, matches its record at
every step, and all ranks confirm the same learning-rate reduction and no precision, with the same words in every part.
No rank hangs: the spawn has a deadline and the collectives a timeout."""

from __future__ import annotations

import hashlib
import json
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import karpathy_train as K
from click.testing import CliRunner

from nanscan import load_bundle
from nanscan.cli.main import main
from spawn_ranks import spawn

SPAWN_TIMEOUT_S = 420
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]
WORLDS = {"ddp": 2, "fsdp": 2, "hsdp": 4, "tp": 4}


def _worker(rank: int, parallel: str, store: str, out: str) -> None:
    from nanscan.runtime.window import Window

    torch.set_num_threads(1)  # the processes share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLDS[parallel],
                            timeout=timedelta(seconds=180))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = K.train(K.LR30, Path(out) / "bundles", parallel=parallel, window=Window(steps=32, every=8),
                          step_fn=K.forward_loss, run_id=f"train-py-{parallel}")
        diagnosis = run.monitor.diagnosis
        # the full weights at the raise (the diagnosis puts everything back), each rank's view: the set's join of its
        # shards must give these (NOTE: [shard chunks])
        weights = {name: hashlib.sha256(_full(p).numpy().tobytes()).hexdigest()
                   for name, p in run.monitor.model.state_dict().items()}
        result = {"weights": weights, "step": run.nonfinite_step, "truth": run.truth, "message": str(run.error),
                  "bundle": str(run.monitor.bundle_path), "verdict": diagnosis.verdict if diagnosis else None,
                  "headline": diagnosis.headline() if diagnosis else None,
                  "fixes": diagnosis.fixes if diagnosis else None, "seconds": diagnosis.seconds if diagnosis else None}
    except Exception as exc:  # noqa: BLE001 - written for the test to show
        result = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


@pytest.fixture(scope="module", params=list(WORLDS))
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    world = WORLDS[request.param]
    spawn(_worker, request.param, world, out, timeout_s=SPAWN_TIMEOUT_S, label=f"train.py under {request.param}")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    if request.param != "ddp" and any("exception" in r and "fully_shard" in r["exception"] for r in results):
        pytest.skip(f"FSDP2 does not run train.py's model on gloo/CPU here: {results[0]['exception']}")
    return request.param, results


def test_every_rank_diagnoses_the_window_together_and_confirms_the_learning_rate(ranks):
    parallel, results = ranks
    for rank, r in enumerate(results):
        assert "exception" not in r, r
        assert r["step"] is not None and r["verdict"] == "done", r
        assert any(key.startswith("lr-") for key in r["fixes"]), r["headline"]
        assert not set(r["fixes"]) & {"fp32", "bf16-autocast", "fp16-autocast"}, r["headline"]
        assert r["headline"] == results[0]["headline"] and r["step"] == results[0]["step"]
        assert f"diagnosis over the window in process: {r['headline']}" in r["message"]
    bundle = load_bundle(Path(results[0]["bundle"]).parent)
    for rank in range(len(results)):
        findings = {f["key"]: f for f in bundle.part(rank).findings()}
        window = findings["replay:window"]["record"]
        assert window["reproduced"] and window["first_departure"] is None, (parallel, rank, window["steps"][-3:])
        assert findings["diagnosis"]["title"] == f"Diagnosis in process: {results[0]['headline']}"
    print(f"\n{parallel}: failing step {results[0]['step']}, diagnosis {results[0]['seconds']:.1f} s on rank 0: "
          f"{results[0]['headline']}")


def test_the_set_joins_every_layout_in_one_process_and_replays_there(ranks):
    """One process, no mesh: the set's state joins every rank's blocks into the full weights the job held (FSDP2,
    HSDP, and TP's column and row splits with FSDP2's strided shards over them: NOTE: [shard chunks]), bit for bit,
    and so does each kept state of the window; `nanscan replay` reruns the failing step from it."""
    parallel, results = ranks
    bundle = load_bundle(Path(results[0]["bundle"]).parent)
    model_state, optimizer_state = bundle.state()
    joined = {name: hashlib.sha256(t.detach().numpy().tobytes()).hexdigest() for name, t in model_state.items()}
    assert joined == results[0]["weights"] == results[-1]["weights"]
    reference = K.build_model(K.full_config(K.LR30))
    window_model, window_optimizer = bundle.window_state(bundle.window["states"][0]["step"])
    reference.load_state_dict(window_model)  # full shapes, every key
    if parallel != "ddp":
        sharded = {path for path in bundle.manifest["distributed"]["shards"]}
        assert any(path.startswith("optimizer/") for path in sharded) and optimizer_state is not None
    out = CliRunner().invoke(main, ["replay", str(bundle.set_path), "--entry", K.ENTRY, "--runs", "1",
                                    "--no-bisect", "--no-record"])
    assert out.exit_code == 0, out.output
    assert "reproduced" in out.output, out.output


def _load_worker(rank: int, job: tuple, store: str, out: str) -> None:
    """Build train.py's model under the run's layout, load the checkpoint one process wrote with plain DCP into its
    sharded state dict, and write the full weights' digests."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp

    parallel, checkpoint = job
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLDS[parallel],
                            timeout=timedelta(seconds=180))
    c = K.full_config(K.LR30)
    model = K.build_model(c)
    K._shard(model, parallel)
    optimizer = model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    weights = {name: hashlib.sha256(_full(t).numpy().tobytes()).hexdigest() for name, t in model.state_dict().items()}
    (Path(out) / f"loaded{rank}.json").write_text(json.dumps(weights))


def test_the_set_as_a_checkpoint_loads_on_the_jobs_own_layout(ranks, tmp_path):
    """`nanscan checkpoint SET`: one process joins the set and writes a DCP checkpoint; the job's layout (FSDP2 on
    2 ranks, FSDP2 + TP on 4) loads it with plain DCP, resharding, and holds the weights the job held at the
    incident, bit for bit (NOTE: [bundle checkpoint])."""
    parallel, results = ranks
    if parallel not in ("fsdp", "tp"):
        pytest.skip("the sharded layouts of 2 and 4 ranks suffice: HSDP loads as FSDP2 does, DDP is not sharded")
    bundle = Path(results[0]["bundle"]).parent
    checkpoint = tmp_path / "ckpt"
    out = CliRunner().invoke(main, ["checkpoint", str(bundle), str(checkpoint)])
    assert out.exit_code == 0, out.output
    spawn(_load_worker, (parallel, str(checkpoint)), WORLDS[parallel], tmp_path / "load", timeout_s=SPAWN_TIMEOUT_S,
          label=f"a checkpoint loaded under {parallel}")
    for rank in range(WORLDS[parallel]):
        loaded = json.loads((tmp_path / "load" / f"loaded{rank}.json").read_text())
        assert loaded == results[0]["weights"], rank
