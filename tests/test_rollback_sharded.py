"""Rollback of sharded weights (issue 62 item 3; nanscan.runtime.rollback NOTE: [rollback]): karpathy's train.py loop
under FSDP2 on 2 gloo ranks and under HSDP on a 2x2 mesh, its forward NaN on rank 1 at one iteration, with
on_invalid=Rollback(skip="window"). Every rank rolls back at the same step to its own kept shards, loaded back into
the sharded parameters and the optimizer's sharded state in place (nanscan.runtime.shards.placed_model_state), and
the run goes on to its end finite and recovered, its loss right after at the restored state's level; under HSDP the
two replicas of each shard are bit-identical afterwards (and the Monitor's replica check, on at every step, found no
difference). At lr 30 the same rollback reloads step 24's shards (the loss falls from 2.4e9 back to step 24's
1.4e8) and is rightly "not recovered": under a group no spike dates the episode's start."""

from __future__ import annotations

import hashlib
import math
import json
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import karpathy_train as K
from nanscan import Rollback
from nanscan.runtime.window import Window
from spawn_ranks import spawn

SPAWN_TIMEOUT_S = 420
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]
WORLDS = {"fsdp": 2, "hsdp": 4}
ITERS = 40
FAULT = (21, 1)  # (iteration, rank)


def _worker(rank: int, parallel: str, store: str, out: str) -> None:
    torch.set_num_threads(1)  # the processes share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLDS[parallel],
                            timeout=timedelta(seconds=180))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = K.train({"max_iters": ITERS}, Path(out) / "bundles", parallel=parallel, fault=FAULT,
                      window=Window(steps=16, every=4), on_invalid=Rollback(skip="window", settle_steps=8),
                      run_id=f"train-py-{parallel}")
    local = {name: hashlib.sha256(K._local(t).detach().numpy().tobytes()).hexdigest()
             for name, t in run.monitor.model.state_dict().items()}
    finite = all(bool(torch.isfinite(K._local(p)).all()) for p in run.monitor.model.parameters())
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "error": str(run.error) if run.error else None, "losses": run.losses, "finite": finite, "local": local,
        "replicas": run.monitor._agreement.replicas}))


@pytest.fixture(scope="module", params=list(WORLDS))
def rolled(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    spawn(_worker, request.param, WORLDS[request.param], out, timeout_s=SPAWN_TIMEOUT_S,
          label=f"train.py rolled back under {request.param}")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLDS[request.param])]
    entries = json.loads((out / "bundles" / f"train-py-{request.param}" / "rollbacks.json").read_text())["rollbacks"]
    return request.param, results, entries


def test_every_rank_rolls_back_its_shards_together_and_the_run_recovers(rolled):
    parallel, results, entries = rolled
    (entry,) = entries
    assert entry["at_step"] == FAULT[0] and entry["skip"] == "window" and entry["restored_step"] == 20, entry
    assert entry["outcome"]["status"] == "recovered", entry["outcome"]
    for r in results:
        assert r["error"] is None and r["finite"], r["error"]
        losses = r["losses"]
        assert len(losses) == ITERS + 1 and all(math.isfinite(loss) for loss in losses[FAULT[0] + 1:])
        # the step after the rollback trains from step 20's state: its loss is at that level, not the NaN's
        assert abs(losses[FAULT[0] + 1] - losses[20]) < 0.25 * losses[20], (losses[19:24])
    if parallel == "hsdp":  # mesh (replicate, shard): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
        assert all(r["replicas"] for r in results)  # compared at every check, no mismatch raised
        assert results[0]["local"] == results[2]["local"] and results[1]["local"] == results[3]["local"]
        assert results[0]["local"] != results[1]["local"]
