"""Replica agreement over a device mesh (nanscan.runtime.replicas NOTE: [replica agreement]), 4 ranks on CPU with
gloo, real FSDP2 and tensor parallelism:
- HSDP (`fully_shard` over a (replicate 2, shard 2) mesh): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1, bit
  for bit; a mantissa bit flipped in rank 3's parameter shard, or in its Adam moment, is caught at that step as
  replica_mismatch naming ranks 1 and 3 (2 replicas: cannot tell which) and the shard's tensor.
- Tensor parallelism under FSDP2 (a (dp 2, tp 2) mesh): the row-parallel layer's bias is replicated over the
  tensor-parallel dimension; a bit flipped in rank 1's copy names ranks 0 and 1. The tensor-parallel shards
  themselves differ on every rank and are never compared.
Healthy runs of both raise nothing; plain FSDP2 (nothing replicated) compares nothing and refuses replicas=True.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spawn_ranks import spawn

from nanscan import Monitor, NonFiniteError, load_bundle
from nanscan.bundle import BundleSet
from nanscan.incident import REPLICA_MISMATCH

WORLD = 4
FLIP_STEP = 4
FLIP_STEPS = 6
HEALTHY_STEPS = 40
SPAWN_TIMEOUT_S = 420  # 4 processes importing torch on 2 shared cores, then FSDP2's collectives on gloo
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))


def make_batch(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g)}


def flip_bit(t: torch.Tensor, index: int = 1, bit: int = 2) -> None:
    """Flip a low mantissa bit of one float32 element of a local tensor in place: it stays finite."""
    with torch.no_grad():
        t.view(-1).view(torch.int32)[index] ^= 1 << bit


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _build(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:  # plain FSDP2 over the whole world: every tensor sharded, nothing replicated
        fully_shard(model)
    return model


def _run(rank: int, bundles: Path, layout: str, name: str, *, steps: int, flip: str | None = None,
         flip_rank: int | None = None) -> dict:
    model = _build(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, bundle_dir=bundles, run_id=name)
    record = {"updated": 0, "error": None, "compared": mon._agreement.replicas,
              "sets": [list(s) for s in mon._agreement._replicas.table] if mon._agreement._replicas else []}
    for step in range(steps):
        if step == FLIP_STEP and rank == flip_rank:
            if flip == "param":
                flip_bit(_local(model[0].weight))
            elif flip == "exp_avg":
                flip_bit(_local(opt.state[model[2].weight]["exp_avg"]), index=0)
            elif flip == "bias":
                flip_bit(_local(model[2].bias))
        batch = make_batch(rank // 2 if layout == "tp" else rank, step)  # tp ranks share their batch
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        try:
            mon.check(batch=batch, loss=loss)
        except NonFiniteError as err:
            record["error"] = {"type": type(err).__name__, "step": err.step, "category": err.category,
                               "tensors": err.tensors, "message": str(err), "bundle_path": str(err.bundle_path),
                               "odd_ranks": getattr(err, "odd_ranks", None)}
            break
        opt.step()
        record["updated"] += 1
    mon.close()
    return record


def _refuses_replicas_true() -> str:
    model = _build("fsdp")
    try:
        Monitor(model, torch.optim.AdamW(model.parameters()), replicas=True)
    except ValueError as err:
        return str(err)
    return ""


def _worker(rank: int, _arg, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=COLLECTIVE_TIMEOUT)
    out = Path(out)
    bundles = out / "bundles"
    results = {
        "hsdp-param": _run(rank, bundles, "hsdp", "hsdp-param", steps=FLIP_STEPS, flip="param", flip_rank=3),
        "hsdp-exp_avg": _run(rank, bundles, "hsdp", "hsdp-exp_avg", steps=FLIP_STEPS, flip="exp_avg", flip_rank=3),
        "tp-bias": _run(rank, bundles, "tp", "tp-bias", steps=FLIP_STEPS, flip="bias", flip_rank=1),
        "healthy-hsdp": _run(rank, bundles, "hsdp", "healthy-hsdp", steps=HEALTHY_STEPS),
        "healthy-tp": _run(rank, bundles, "tp", "healthy-tp", steps=HEALTHY_STEPS),
        "fsdp": _run(rank, bundles, "fsdp", "fsdp", steps=2),
        "refused": _refuses_replicas_true(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas-mesh")
    spawn(_worker, None, WORLD, out, timeout_s=SPAWN_TIMEOUT_S, label="replicas over a device mesh")
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("run, tensor", [("hsdp-param", "param:0.weight@shard1/2"),
                                         ("hsdp-exp_avg", "optim:2.weight@shard1/2.exp_avg")])
def test_hsdp_a_flip_in_one_replica_of_a_shard_names_the_shards_two_holders(mesh, run, tensor):
    out, ranks = mesh
    for rank, results in enumerate(ranks):
        r = results[run]
        assert r["compared"] is True and r["sets"] == [[0, 2], [1, 3]]
        err = r["error"]
        assert err is not None and err["type"] == "ReplicaMismatchError", (rank, err)
        assert (err["step"], err["category"], err["odd_ranks"]) == (FLIP_STEP, REPLICA_MISMATCH, [1, 3])
        assert err["tensors"] == [tensor] and "cannot tell which" in err["message"]
        assert r["updated"] == FLIP_STEP
    set_dir = out / "bundles" / run / f"step-{FLIP_STEP}"
    bundle = load_bundle(set_dir)
    assert isinstance(bundle, BundleSet) and sorted(bundle.parts) == [0, 1, 2, 3]
    replicas = bundle.index["replicas"]
    assert replicas["who"] == "cannot_tell" and replicas["odd_ranks"] == [1, 3]
    first = replicas["first_differing"][0]
    assert first["name"] == tensor and sorted(first["fingerprints"]) == ["1", "3"]
    assert first["fingerprints"]["1"] != first["fingerprints"]["3"]
    assert replicas["gradients_compared"] is True and not replicas["gradients_differed"]
    # the other shard's replicas agreed: their parts say another rank stopped them
    assert replicas["involved"] == [1, 3]
    assert [row["category"] for row in bundle.index["ranks"]] == ["other_rank", REPLICA_MISMATCH, "other_rank",
                                                                  REPLICA_MISMATCH]


def test_tensor_parallel_a_flip_in_a_bias_replicated_over_tp_names_its_tp_group(mesh):
    out, ranks = mesh
    index = load_bundle(out / "bundles" / "tp-bias" / f"step-{FLIP_STEP}").index
    assert index["replicas"]["involved"] == [0, 1] and index["first_bad_ranks"] == [0, 1]
    assert [row["category"] for row in index["ranks"]] == [REPLICA_MISMATCH, REPLICA_MISMATCH, "other_rank",
                                                           "other_rank"]
    for rank, results in enumerate(ranks):
        r = results["tp-bias"]
        assert r["compared"] is True and r["sets"] == [[0, 1], [2, 3]]
        err = r["error"]
        assert err is not None and err["type"] == "ReplicaMismatchError", (rank, err)
        assert (err["step"], err["odd_ranks"]) == (FLIP_STEP, [0, 1])
        assert err["tensors"] == ["param:2.bias@shard0/2"], err


def test_healthy_mesh_runs_raise_nothing(mesh):
    _, ranks = mesh
    for rank, results in enumerate(ranks):
        for name in ("healthy-hsdp", "healthy-tp"):
            r = results[name]
            assert r["error"] is None, (rank, name, r["error"])
            assert r["updated"] == HEALTHY_STEPS and r["compared"] is True


def test_plain_fsdp2_compares_nothing_and_refuses_replicas_true(mesh):
    _, ranks = mesh
    for results in ranks:
        assert results["fsdp"]["compared"] is False and results["fsdp"]["error"] is None
        assert "nothing replicated to compare" in results["refused"]
