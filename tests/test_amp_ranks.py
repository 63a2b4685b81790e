"""GradScaler overflow skips under a process group (nanscan.runtime.distributed NOTE: [agreed skips]): karpathy's
train.py loop in float16 with its GradScaler on 2 gloo ranks under DDP, the scale starting at 2**24 so that its
first steps overflow as a GPU run's do while the scale calibrates. Every rank records the same overflow skips and no
incident (before, the first skip stopped the run as a NaN); a NaN one rank's forward makes at iteration FAULT in the
same fp16 run is still an incident at its step, on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import karpathy_train as K
from spawn_ranks import gloo_rank, spawn, write_result

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
FP16 = {"dtype": "float16", "max_iters": 24, "init_scale": 2.0 ** 24}
FAULT = 14


def _runs(out: str) -> dict:
    healthy = K.train(FP16, Path(out) / "healthy", parallel="ddp", run_id="fp16")
    watch = healthy.monitor._scaler
    faulty = K.train(FP16, Path(out) / "faulty", parallel="ddp", run_id="fp16-nan", fault=(FAULT, 1))
    return {"healthy": {"error": str(healthy.error) if healthy.error else None,
                        "skips": [s.step for s in watch.recent], "skips_total": watch.skips_total,
                        "history_skips": [e.step for e in healthy.monitor.history if e.report.overflow_skip],
                        "bundles": sorted(p.name for p in (Path(out) / "healthy").rglob("step-*"))},
            "faulty": {"step": faulty.nonfinite_step, "category": getattr(faulty.error, "category", None),
                       "first_bad_ranks": list(getattr(faulty.error, "first_bad_ranks", None) or [])}}


def _worker(rank: int, _arg: None, store: str, out: str) -> None:
    gloo_rank(rank, store, 2)
    write_result(out, rank, lambda: _runs(out))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp-ranks")
    spawn(_worker, None, 2, out, timeout_s=240, label="train.py fp16 under DDP")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_rank_records_the_same_overflow_skips_and_no_incident(ranks):
    for rank, result in enumerate(ranks):
        assert "exception" not in result, result.get("traceback", result)
        healthy = result["healthy"]
        assert healthy["error"] is None and not healthy["bundles"], (rank, healthy)
        assert healthy["skips_total"] >= 3 and healthy["skips"][0] == 0, healthy
        assert healthy["history_skips"] == healthy["skips"], healthy
    assert ranks[0]["healthy"]["skips"] == ranks[1]["healthy"]["skips"]


def test_a_nan_in_the_same_fp16_run_is_still_an_incident_at_its_step(ranks):
    for result in ranks:
        faulty = result["faulty"]
        assert faulty["step"] == FAULT and faulty["category"] == "loss" and faulty["first_bad_ranks"] == [1], faulty
