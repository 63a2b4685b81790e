"""Replica agreement under real DDP on CPU with gloo (nanscan.runtime.distributed NOTE: [replica agreement]): a
mantissa bit flipped on one rank (the value stays finite) in a parameter, in the all-reduced gradient through a
communication hook, or in an Adam moment, is caught at that step, naming the rank by majority with 3 ranks (both,
and "cannot tell which", with 2), the tensor, and whether the gradients differed, with a bundle set recording each
rank's host and device; healthy runs (float32, bf16 autocast, fused and foreach AdamW, no_sync accumulation,
find_unused_parameters, gradient_as_bucket_view, static_graph) raise nothing; replicas=False sees nothing.

One 3-rank and one 2-rank group are spawned per session (module fixtures), each running its scenarios in a row;
the gloo collectives have a timeout, the spawn a deadline, and every test a pytest-timeout.
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
from nanscan.bundle.rank_set import INDEX
from nanscan.incident import REPLICA_MISMATCH
from nanscan.review.triage import triage
from nanscan.runtime.replicas import replica_verdict

FLIP_STEP = 5
FLIP_STEPS = 8
HEALTHY_STEPS = 200
SPAWN_TIMEOUT_S = 300  # startup of 3 processes importing torch on 2 shared cores is much of it
COLLECTIVE_TIMEOUT = timedelta(seconds=90)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]  # two processes a set: make test-slow


class Net(nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.spare = nn.Linear(4, 1) if unused else None  # never called: no gradient on any rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_batch(rank: int, step: int, micro: int = 0) -> dict:
    g = torch.Generator().manual_seed(10_000 * rank + 10 * step + micro)
    return {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)}


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 3) -> None:
    """Flip a low mantissa bit of one float32 element in place: the value stays finite and moves by ~1e-6."""
    with torch.no_grad():
        before = t.detach().view(-1)[index].item()
        t.detach().view(-1).view(torch.int32)[index] ^= 1 << bit
        after = t.detach().view(-1)[index].item()
    assert after != before and abs(after) < float("inf")


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)  # several processes share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)


def _run(rank: int, world: int, bundles: Path, name: str, *, steps: int, flip: str | None = None,
         flip_rank: int | None = None, optimizer: str = "adam", autocast: bool = False, accumulate: int = 1,
         ddp_args: dict | None = None, unused: bool = False, replicas: bool | None = None) -> dict:
    """One training run under DDP with a Monitor; a bit of rank `flip_rank` flipped at FLIP_STEP in the `flip`
    place ("param", "grad" through the comm hook, "exp_avg")."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Net(unused)
    ddp = DDP(model, **(ddp_args or {}))
    hook_state = {"step": -1}
    if flip == "grad":
        def flipping_allreduce(state, bucket):
            def maybe_flip(fut):
                reduced = fut.value()
                if rank == flip_rank and hook_state["step"] == FLIP_STEP:
                    flip_bit(reduced)  # its first element: the first gradient in the bucket's own order
                    names = {id(p): n for n, p in model.named_parameters()}
                    hook_state["flipped"] = f"grad:{names[id(bucket.parameters()[0])]}"
                return reduced
            return default_hooks.allreduce_hook(state, bucket).then(maybe_flip)
        ddp.register_comm_hook(None, flipping_allreduce)
    kinds = {"adam": dict(), "fused": dict(fused=True), "foreach": dict(foreach=True)}
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, **kinds[optimizer])
    mon = Monitor(ddp, opt, bundle_dir=bundles, run_id=name, config={"scenario": name}, replicas=replicas)
    record = {"updated": 0, "error": None, "compared": mon._agreement.replicas, "flipped": None}
    for step in range(steps):
        hook_state["step"] = step
        if step == FLIP_STEP and rank == flip_rank:
            if flip == "param":
                flip_bit(model.body[0].weight, index=5)
            elif flip == "exp_avg":
                flip_bit(opt.state[model.body[2].weight]["exp_avg"], index=2)
        opt.zero_grad(set_to_none=True)
        try:
            for micro in range(accumulate):
                batch = make_batch(rank, step, micro)
                last = micro == accumulate - 1
                context = ddp.no_sync() if not last else torch.enable_grad()
                with context:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = nn.functional.mse_loss(ddp(batch["x"]).float(), batch["y"]) / accumulate
                    loss.backward()
                    report = mon.check(batch=batch, loss=loss, micro_batch=not last)
        except NonFiniteError as err:
            record["error"] = {"type": type(err).__name__, "step": err.step, "category": err.category,
                               "tensors": err.tensors, "message": str(err), "bundle_path": str(err.bundle_path),
                               "odd_ranks": getattr(err, "odd_ranks", None),
                               "first_bad_ranks": getattr(err, "first_bad_ranks", None)}
            break
        assert report.ok
        opt.step()
        record["updated"] += 1
    params = [p.detach().clone() for p in model.parameters()]
    gathered = [[torch.empty_like(p) for _ in range(world)] for p in params]
    for p, out in zip(params, gathered):
        dist.all_gather(out, p)
    record["flipped"] = hook_state.get("flipped")
    record["params_equal"] = all(torch.equal(out[0], o) for out in gathered for o in out[1:])
    mon.close()
    return record


def _worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    out = Path(out)
    bundles = out / "bundles"
    results = {}
    if world == 3:
        for place in ("param", "grad", "exp_avg"):
            results[place] = _run(rank, world, bundles, f"flip-{place}", steps=FLIP_STEPS, flip=place, flip_rank=2)
        healthy = {"fused": dict(optimizer="fused"), "no_sync": dict(accumulate=2),
                   "bucket_view_static": dict(ddp_args=dict(gradient_as_bucket_view=True, static_graph=True))}
    else:
        results["two"] = _run(rank, world, bundles, "flip-two", steps=FLIP_STEPS, flip="param", flip_rank=1)
        results["off"] = _run(rank, world, bundles, "flip-off", steps=FLIP_STEPS, flip="param", flip_rank=1,
                              replicas=False)
        healthy = {"float32": {}, "bf16": dict(autocast=True), "foreach": dict(optimizer="foreach"),
                   "unused": dict(unused=True, ddp_args=dict(find_unused_parameters=True))}
    for name, args in healthy.items():
        results[f"healthy-{name}"] = _run(rank, world, bundles, f"healthy-{name}", steps=HEALTHY_STEPS, **args)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _spawn(world: int, out: Path) -> list[dict]:
    spawn(_worker, world, world, out, timeout_s=SPAWN_TIMEOUT_S, label=f"replicas on {world} ranks")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas3")
    return out, _spawn(3, out)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas2")
    return out, _spawn(2, out)


# -- the verdict from gathered fingerprints (no processes) ------------------------------------------------------

def _everyone(*columns: list[str]) -> list[dict]:
    names = ["param:a", "param:b", "grad:a"]
    return [{"names": names, "fingerprints": list(col)} for col in columns]


def test_the_verdict_names_the_odd_rank_by_majority_and_cannot_tell_with_two():
    same, other = "0" * 16, "0" * 15 + "1"
    three = replica_verdict(_everyone([same] * 3, [same, other, same], [same] * 3),
                            ("parameter",), gradients=True)
    assert (three["odd_ranks"], three["who"], three["tensors"]) == ([1], "majority", ["param:b"])
    assert not three["gradients_differed"] and "all-reduced gradients agreed" in three["cause"]
    two = replica_verdict(_everyone([same] * 3, [same, other, same]), ("parameter", "gradient"), gradients=True)
    assert (two["odd_ranks"], two["who"]) == ([0, 1], "cannot_tell") and "cannot tell which" in two["ranks_text"]
    assert two["gradients_differed"] and "communication" in two["cause"]
    split = replica_verdict(_everyone([same] * 3, [other] * 3, ["2" * 16] * 3, [same] * 3),
                            ("parameter",), gradients=False)
    assert split["who"] == "no_majority" and split["odd_ranks"] == [0, 1, 2, 3]
    assert "not compared at this micro-batch check" in split["cause"]


# -- three ranks: a flip on rank 2, by majority -----------------------------------------------------------------

@pytest.mark.parametrize("place, group, tensor", [
    ("param", "parameter", "param:body.0.weight"),
    ("grad", "gradient", None),  # the gradient the hook flipped, as rank 2 recorded it
    ("exp_avg", "optimizer_state", "optim:body.2.weight.exp_avg"),
])
def test_a_flipped_bit_on_one_rank_is_caught_at_that_step_naming_the_rank_and_tensor(three, place, group, tensor):
    out, ranks = three
    set_dir = out / "bundles" / f"flip-{place}" / f"step-{FLIP_STEP}"
    if tensor is None:
        tensor = ranks[2][place]["flipped"]
        assert tensor is not None and tensor.startswith("grad:")
    for rank, results in enumerate(ranks):
        r = results[place]
        err = r["error"]
        assert r["compared"] is True
        assert err is not None and err["type"] == "ReplicaMismatchError", r
        assert (err["step"], err["category"], err["odd_ranks"]) == (FLIP_STEP, REPLICA_MISMATCH, [2])
        assert err["first_bad_ranks"] == [2] and err["bundle_path"] == str(set_dir)
        assert tensor in err["tensors"], err["tensors"]
        assert "rank 2 is the odd one out (ranks 0, 1 agree)" in err["message"]
        assert r["updated"] == FLIP_STEP, "the flipped step's update must not be applied"
    index = json.loads((set_dir / INDEX).read_text())
    replicas = index["replicas"]
    assert index["category"] == REPLICA_MISMATCH and index["first_bad_ranks"] == [2] and index["world_size"] == 3
    assert replicas["groups"] == [group] and replicas["odd_ranks"] == [2] and replicas["who"] == "majority"
    assert replicas["gradients_differed"] is (place == "grad") and replicas["gradients_compared"] is True
    first = replicas["first_differing"][0]
    assert first["name"] == tensor and first["fingerprints"]["0"] == first["fingerprints"]["1"] != \
        first["fingerprints"]["2"]
    if place == "grad":  # the flip was in one element of the reduced bucket: that gradient only
        assert replicas["tensors"] == [tensor]
    # every rank's part records its host and device; the index summarises them
    hosts = {row["host"] for row in index["ranks"]}
    assert len(hosts) == 1 and index["hosts"][0]["ranks"] == [0, 1, 2]
    assert all(row["device"]["device"] == "cpu" and row["device"]["uuid"] is None for row in index["ranks"])
    bundle = load_bundle(set_dir)
    assert isinstance(bundle, BundleSet) and bundle.rank == 2 and sorted(bundle.parts) == [0, 1, 2]
    assert bundle.category == REPLICA_MISMATCH and bundle.manifest["reason"] == REPLICA_MISMATCH
    part = bundle.part(2)
    assert part.manifest["distributed"]["device"]["host"] in hosts
    assert part.manifest["distributed"]["replicas"]["odd_ranks"] == [2]
    note = (part.path / "INCIDENT.md").read_text()
    assert "Replicas differ at step" in note and f"`{tensor}`" in note and "rank 2 is the odd one out" in note


def test_three_ranks_healthy_runs_raise_nothing(three):
    _, ranks = three
    for rank, results in enumerate(ranks):
        for name in ("healthy-fused", "healthy-no_sync", "healthy-bucket_view_static"):
            r = results[name]
            assert r["error"] is None, (rank, name, r["error"])
            assert r["updated"] == HEALTHY_STEPS and r["compared"] is True and r["params_equal"]


def test_triage_groups_the_incidents_by_the_host_and_device_of_their_first_bad_rank(three):
    out, _ = three
    result = triage(out / "bundles")
    replica = [e for e in result.entries if e.category == REPLICA_MISMATCH]
    assert len(replica) == 3 and all(e.first_bad_ranks == [2] and e.device == "cpu" for e in replica)
    (host,) = result.by_host()
    assert host["count"] == 3 and host["devices"] == {"cpu": 3} and host["ranks"] == {"2": 3}
    assert result.to_dict()["hosts"] == result.by_host()


# -- two ranks: both named; replicas=False; more healthy runs ----------------------------------------------------

def test_two_ranks_name_both_and_say_they_cannot_tell_which(two):
    out, ranks = two
    for rank, results in enumerate(ranks):
        err = results["two"]["error"]
        assert err is not None and err["type"] == "ReplicaMismatchError"
        assert (err["step"], err["odd_ranks"], err["first_bad_ranks"]) == (FLIP_STEP, [0, 1], [0, 1])
        assert "cannot tell which" in err["message"] and "param:body.0.weight" in err["tensors"]
    index = json.loads((out / "bundles" / "flip-two" / f"step-{FLIP_STEP}" / INDEX).read_text())
    assert index["replicas"]["who"] == "cannot_tell" and index["bad_ranks"] == [0, 1]


def test_replicas_false_turns_the_comparison_off(two):
    out, ranks = two
    for results in ranks:
        r = results["off"]
        assert r["compared"] is False and r["error"] is None and r["updated"] == FLIP_STEPS
        assert not r["params_equal"], "the flip is still there, unseen"
    assert not (out / "bundles" / "flip-off").exists()


def test_two_ranks_healthy_runs_raise_nothing(two):
    _, ranks = two
    for rank, results in enumerate(ranks):
        for name in ("healthy-float32", "healthy-bf16", "healthy-foreach", "healthy-unused"):
            r = results[name]
            assert r["error"] is None, (rank, name, r["error"])
            assert r["updated"] == HEALTHY_STEPS and r["compared"] is True and r["params_equal"]
