"""Rollback on 2 gloo ranks in karpathy's train.py loop under DistributedDataParallel (issue 60; nanscan.runtime
.rollback NOTE: [rollback], nanscan.runtime.dropped_update NOTE: [dropped update]): each rank draws its own records
with torch's global generator (seeded by its rank, as train.py's seed_offset), and one record that only rank 1 draws
first is NaN. Both ranks roll back at the same step, rank 1's bad row is quarantined (rank 0 writes the file, every
rank knows it), and every later step whose batch holds the record on any rank has its update dropped on every rank,
so the replicas stay identical; no generator is rewound, and the run finishes finite."""

from __future__ import annotations

import json
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import test_rollback_data as D
from nanscan import Rollback
from nanscan.bundle.quarantine import read_quarantine
from spawn_ranks import spawn

SPAWN_TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]
WORLD = 2


def simulated_draws(rank: int) -> list[list[str]]:
    """The records each iteration of rank `rank` draws (run's get_batch on torch's generator, seeded SEED + rank):
    what a run whose generator no rollback rewound draws."""
    g = torch.Generator().manual_seed(D.SEED + rank)
    size, accum = D.CONFIG["batch_size"], D.CONFIG["gradient_accumulation_steps"]
    draws = [[f"rec-{i}" for i in torch.randint(D.RECORDS, (size,), generator=g).tolist()]
             for _ in range(1 + D.ITERS * accum)]
    return [sum(draws[it * accum:(it + 1) * accum], []) for it in range(D.ITERS)]


def bad_record() -> tuple[str, int]:
    """A record rank 1 draws first (no rank drew it before) in micro-batch 0 alone of an iteration from 2 on, that
    rank 0 draws later: the record and that iteration."""
    half = D.CONFIG["batch_size"]
    ranks = [simulated_draws(r) for r in range(WORLD)]
    for it in range(2, D.ITERS):
        for record in ranks[1][it][:half]:
            seen_before = any(record in ids for r in ranks for ids in r[:it])
            later_on_0 = any(record in ids for ids in ranks[0][it + 1:])
            if not seen_before and record not in ranks[1][it][half:] and record not in ranks[0][it] and later_on_0:
                return record, it
    raise AssertionError("no record fits; change SEED")


def _worker(rank: int, bad: str, store: str, out: str) -> None:
    torch.set_num_threads(1)  # two processes share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = D.run(Path(out) / "bundles", bad, Rollback(), rank=rank)
    weights = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "drawn": result.drawn, "unchanged": result.unchanged, "finite": result.finite,
        "incident": result.monitor.first_invalid_step, "weights": weights.tolist()}))


def test_both_ranks_roll_back_quarantine_rank_1s_record_and_drop_it_together_later(tmp_path):
    bad, at = bad_record()
    spawn(_worker, bad, WORLD, tmp_path, timeout_s=SPAWN_TIMEOUT_S, label="train.py records under DDP")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    run_dir = tmp_path / "bundles" / "records"
    (entry,) = json.loads((run_dir / "rollbacks.json").read_text())["rollbacks"]
    assert entry["at_step"] == at and entry["skip"] == "step" and entry["quarantined"] == [bad], entry
    assert [r.id for r in read_quarantine(tmp_path / "bundles").active()] == [bad]
    holding = sorted({it for r in range(WORLD) for it, ids in enumerate(results[r]["drawn"]) if bad in ids})
    assert holding[0] == at and len(holding) >= 2
    for rank, r in enumerate(results):
        assert r["drawn"] == simulated_draws(rank)  # no generator rewound on any rank
        assert r["finite"] and r["incident"] is None  # the later draws of the record are no new incident
        # the failing step and every later step that drew the record on either rank: dropped on both ranks
        assert r["unchanged"] == holding, (rank, r["unchanged"], holding)
    assert results[0]["weights"] == results[1]["weights"]  # the replicas stayed identical
