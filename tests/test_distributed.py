"""Distributed agreement on CPU with gloo: DDP (4 processes) and FSDP2 (2 processes) with a NaN planted in rank 1's
batch at step 7. Every rank must stop (or skip) at the same step, the bundle set's index must name rank 1, writing
the set again must change nothing, and the set must read back, report and replay in one process.

Each multi-process group is spawned once per test session (module fixtures) and runs several scenarios in a row;
the tests assert on what every rank recorded. The workers leave the scenarios' results in JSON and safetensors
files. A hung rank cannot hang the suite: the gloo collectives have a timeout, the spawn is joined with a deadline
and killed after it, and every test has a pytest-timeout.
"""

from __future__ import annotations

import hashlib
import json
import socket
import shutil
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from torch import nn

from spawn_ranks import spawn

from nanscan import Monitor, NonFiniteError, NonFiniteWarning, Rollback, load_bundle
from nanscan.bundle import BundleError
from nanscan.cli.main import main
from nanscan.bundle import BundleSet
from nanscan.bundle.rank_set import INDEX
from nanscan.incident import OTHER_RANK
from nanscan.entry import ReplaySpec, replay_entry as marked_entry
from nanscan.review.triage import triage

FAULT_RANK = 1
FAULT_STEP = 7
STEPS = 10
SPAWN_TIMEOUT_S = 240  # startup of 4 processes importing torch on 2 shared cores is most of it
COLLECTIVE_TIMEOUT = timedelta(seconds=90)
REPLAY_ENTRY = f"{Path(__file__).stem}:replay_entry"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]  # two processes a set: make test-slow


# -- the training step, shared by the workers and the replay entry ---------------------------------------------

def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))  # Linear(8, 1) leaves rank 1 an empty shard


def make_batch(rank: int, step: int, fault: str | None) -> dict:
    """Each rank's own data. fault "x": NaN in the model's input (it spreads to every rank's gradients through
    the gradient collectives); "aux": NaN in a batch tensor the model never reads (only rank 1 sees it)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g),
             "aux": torch.randn(8, generator=g)}
    if fault == "x" and rank == FAULT_RANK and step == FAULT_STEP:
        batch["x"][2, 1] = float("nan")
    elif fault == "aux" and rank == FAULT_RANK and step == FAULT_STEP:
        batch["aux"][2] = float("nan")
    return batch


def step_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


@marked_entry
def replay_entry(config: dict) -> ReplaySpec:
    return ReplaySpec(model=make_model(), optimizer=make_optimizer, step_fn=step_loss)


def sample_ids(rank: int, step: int) -> list[str]:
    return [f"r{rank}-s{step}-{i}" for i in range(8)]


# -- the workers ------------------------------------------------------------------------------------------------

def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)  # several processes share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)


def _error_fields(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err), "step": getattr(err, "step", None),
            "category": getattr(err, "category", None), "tensors": getattr(err, "tensors", None),
            "first_bad_ranks": getattr(err, "first_bad_ranks", None), "bad_ranks": getattr(err, "bad_ranks", None),
            "local_category": getattr(err, "local_category", None),
            "bundle_path": str(getattr(err, "bundle_path", None))}


def _train(rank: int, model: nn.Module, optimizer, mon: Monitor, fault: str | None, *, flush: bool = False,
           step_offset: int = 0) -> dict:
    """The loop of the Monitor's docstring; returns which steps were updated and what each check said."""
    record = {"updated": [], "ok": [], "local_ok": [], "error": None, "error_at": None}
    for step in range(STEPS):
        batch = make_batch(rank, step, fault)
        loss = step_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        where = "check"
        try:
            report = mon.check(batch=batch, loss=loss, sample_ids=sample_ids(rank, step), step=step + step_offset)
            if flush:
                where = "flush"
                mon.flush()
        except (NonFiniteError, RuntimeError) as err:
            record["error"], record["error_at"] = _error_fields(err), {"where": where, "step": step}
            break
        record["ok"].append(report.ok)
        record["local_ok"].append(getattr(report, "local_ok", report.ok))
        if not report.ok:
            continue
        optimizer.step()
        record["updated"].append(step)
    return record


def _file_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _save_state(path: Path, model: nn.Module) -> None:
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))


def _ddp_worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, world, store)
    out = Path(out)
    bundles = out / "bundles"
    results = {}

    def run(name: str, fault: str | None, **monitor_args) -> None:
        model = make_model()
        ddp = DDP(model)
        optimizer = make_optimizer(ddp)
        mon = Monitor(ddp, optimizer, bundle_dir=bundles, config={"scenario": name}, replay_entry=REPLAY_ENTRY,
                      **monitor_args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[name] = _train(rank, ddp, optimizer, mon, fault)
        results[name]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, NonFiniteWarning)]
        results[name]["run_id"] = mon.run_id
        results[name]["first_invalid_step"] = mon.first_invalid_step
        results[name]["bundle_path"] = str(mon.bundle_path)
        results[name]["finite"] = all(torch.isfinite(p).all().item() for p in model.parameters())
        _save_state(out / f"{name}-rank{rank}.safetensors", model)
        mon.close()

    run("sync", "x", run_id="ddp-sync", step_fn=step_loss)
    dist.barrier()
    set_dir = bundles / "ddp-sync" / f"step-{FAULT_STEP}"
    before = _file_hashes(set_dir) if rank == 0 else None
    run("rerun", "x", run_id="ddp-sync", step_fn=step_loss)
    dist.barrier()
    if rank == 0:
        results["rerun"]["hashes_before"], results["rerun"]["hashes_after"] = before, _file_hashes(set_dir)
    run("async", "aux", agreement="async")  # no run_id: every rank takes rank 0's
    run("skip", "aux", on_invalid="skip", run_id="ddp-skip")
    run("rollback", "x", on_invalid=Rollback(skip="step"), run_id="ddp-rollback")
    # a rank that numbers its steps differently must not leave the others waiting: all raise
    model = make_model()
    optimizer = make_optimizer(model)
    mon = Monitor(DDP(model), optimizer, bundle_dir=bundles, run_id="ddp-mismatch")
    results["mismatch"] = _train(rank, model, optimizer, mon, None, step_offset=int(rank == 2))
    (out / f"ddp-rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    out = Path(out)
    results = {}
    try:
        from torch.distributed.fsdp import fully_shard

        probe = make_model()
        fully_shard(probe)
        step_loss(probe, make_batch(rank, 0, None)).backward()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which skips with this reason
        (out / f"fsdp-rank{rank}.json").write_text(json.dumps({"unsupported": f"{type(exc).__name__}: {exc}"}))
        dist.destroy_process_group()
        return

    for name, monitor_args, flush in (("sync", {"snapshot": "cpu", "step_fn": step_loss}, False),
                                      ("flush", {"agreement": "async"}, True)):
        model = make_model()
        fully_shard(model)
        optimizer = make_optimizer(model)
        mon = Monitor(model, optimizer, bundle_dir=out / "bundles", run_id=f"fsdp-{name}", config={"scenario": name},
                      replay_entry=REPLAY_ENTRY, **monitor_args)
        results[name] = _train(rank, model, optimizer, mon, "x", flush=flush)
        results[name]["bundle_path"] = str(mon.bundle_path)
        # the full tensors, gathered from the shards (a collective: every rank takes part, rank 0 keeps them)
        full = {f"model/{k}": v.full_tensor() for k, v in model.state_dict().items()}
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                full[f"optimizer/{index}/{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
        if rank == 0:
            save_file({k: v.detach().clone().contiguous() for k, v in full.items()},
                      str(out / f"fsdp-{name}-full.safetensors"))
    (out / f"fsdp-rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _fsdp_one_worker(rank: int, world: int, store: str, out: str) -> None:
    """FSDP2 on a group of one rank (a job launched with torchrun on one GPU): the rank holds every weight, so the
    in-process rerun runs through the sharded module, with no other rank to wait for."""
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, store)
    model = make_model()
    fully_shard(model)
    optimizer = make_optimizer(model)
    mon = Monitor(model, optimizer, bundle_dir=Path(out) / "bundles", run_id="fsdp-one", step_fn=step_loss)
    with pytest.raises(NonFiniteError):
        for step in range(STEPS):
            batch = make_batch(FAULT_RANK, step, "x")  # this rank draws the faulty batch
            loss = step_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            mon.check(batch=batch, loss=loss)
            optimizer.step()
    (Path(out) / "fsdp-rank0.json").write_text(json.dumps(
        {"verdict": mon.rerun.verdict, "reason": mon.rerun.reason, "headline": mon.rerun.headline()}))
    dist.destroy_process_group()


def _spawn(worker, world: int, out: Path) -> list[dict]:
    """Run `worker` on `world` processes; every rank's results. Killed after SPAWN_TIMEOUT_S."""
    spawn(worker, world, world, out, timeout_s=SPAWN_TIMEOUT_S, label=worker.__name__)
    name = "ddp" if worker is _ddp_worker else "fsdp"  # _fsdp_one_worker's too
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return out, _spawn(_ddp_worker, 4, out)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    ranks = _spawn(_fsdp_worker, 2, out)
    if "unsupported" in ranks[0]:
        pytest.skip(f"FSDP2 (fully_shard) does not run on gloo/CPU with torch {torch.__version__}: "
                    f"{ranks[0]['unsupported']}")
    return out, ranks


def _set_dir(out: Path, run_id: str) -> Path:
    return out / "bundles" / run_id / f"step-{FAULT_STEP}"


# -- DDP, 4 processes -------------------------------------------------------------------------------------------

def test_ddp_every_rank_stops_at_the_failing_step_and_the_index_names_rank_1(ddp):
    out, ranks = ddp
    set_dir = _set_dir(out, "ddp-sync")
    for rank, results in enumerate(ranks):
        r = results["sync"]
        err = r["error"]
        assert err["type"] == "DistributedNonFiniteError" and r["error_at"] == {"where": "check", "step": FAULT_STEP}
        assert (err["step"], err["category"], err["tensors"]) == (FAULT_STEP, "input", ["input:x"])
        assert err["first_bad_ranks"] == [FAULT_RANK] and err["bad_ranks"] == [0, 1, 2, 3]
        # the NaN reached the other ranks only through the gradient all-reduce
        assert err["local_category"] == ("input" if rank == FAULT_RANK else "gradient")
        assert err["bundle_path"] == r["bundle_path"] == str(set_dir)
        assert "rank 1 first" in err["message"] and f"step {FAULT_STEP}" in err["message"]
        assert r["updated"] == list(range(FAULT_STEP)), "step 7's update must not be applied on any rank"
    states = [load_file(out / f"sync-rank{r}.safetensors") for r in range(4)]
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])

    index = json.loads((set_dir / INDEX).read_text())
    assert (index["first_bad_ranks"], index["bad_ranks"], index["category"]) == ([1], [0, 1, 2, 3], "input")
    assert index["category_tensors"] == {"1": ["input:x"]} and index["world_size"] == 4
    assert [row["dir"] for row in index["ranks"]] == [f"rank-{r}" for r in range(4)]
    assert [row["category"] for row in index["ranks"]] == ["gradient", "input", "gradient", "gradient"]

    bundle = load_bundle(set_dir)
    assert isinstance(bundle, BundleSet) and bundle.rank == FAULT_RANK and sorted(bundle.parts) == [0, 1, 2, 3]
    assert bundle.step == FAULT_STEP and bundle.category == "input"
    assert torch.isnan(bundle.batch()["x"]).sum().item() == 1
    assert bundle.sample_ids == sample_ids(FAULT_RANK, FAULT_STEP)
    # names are the unwrapped model's (no "module." prefix), and the stored weights are those before step 7's update
    model_state, _ = bundle.state()
    assert sorted(model_state) == sorted(states[0])
    assert all(torch.equal(model_state[k], states[1][k]) for k in model_state)
    assert bundle.part(2).category == "gradient"
    assert bundle.part(2).manifest["distributed"]["rank"] == 2
    # a part opened on its own path still opens the whole set, showing that part; so does the run directory
    assert load_bundle(set_dir / "rank-3").rank == 3
    assert load_bundle(set_dir.parent).set_path == set_dir


def test_ddp_the_ranks_that_saw_the_fault_rerun_it_in_process(ddp):
    """Monitor(step_fn=...) under DDP (nanscan.runtime.incident_rerun NOTE: [in-process rerun]): every rank whose own
    tensors went bad reruns its step on the plain module, with no collective (no rank hangs); rank 1's rerun finds
    its batch's NaN, the others' reruns stay finite and name the all-reduce from another rank among what they cannot
    see."""
    out, ranks = ddp
    bundle = load_bundle(_set_dir(out, "ddp-sync"))
    for rank in range(4):
        part = bundle.part(rank)
        assert part.manifest["rerun"]["step_fn"] == "test_distributed:step_loss"
        (finding,) = [f for f in part.findings() if f["key"] == "rerun"]
        record = finding["record"]
        if rank == FAULT_RANK:
            assert record["verdict"] == "reproduced" and record["category"] == "input"
            assert record["localization"]["phase"] == "input"
            assert "rerun in process on this rank: reproduced (input)" in ranks[rank]["sync"]["error"]["message"]
        else:
            assert record["verdict"] == "not reproduced"
            assert record["unseen"][0]["candidate"].startswith("another rank: DDP averages the gradients")
    assert all(r["sync"]["updated"] == list(range(FAULT_STEP)) for r in ranks)


def _diagnoses(bundle, world: int) -> list[dict]:
    """Each rank's in-process diagnosis over the window (nanscan.runtime.incident_diagnosis NOTE: [in-process
    diagnosis]): its conclusion's title and record, and its rows' verdicts and its drop row's detail."""
    found = []
    for rank in range(world):
        findings = {f["key"]: f for f in bundle.part(rank).findings()}
        diagnosis = findings["diagnosis"]
        found.append({"title": diagnosis["title"], "verdict": diagnosis["record"]["verdict"],
                      "rows": {k: f["record"]["verdict"] for k, f in findings.items() if k.startswith("ablate:window:")},
                      "window": findings["replay:window"]["record"],
                      "drop": findings["ablate:window:drop-suspicious"]["record"]["detail"]})
    return found


def _assert_diagnosed_together(bundle, world: int) -> None:
    """Every rank reran the window together from its own kept state with its own batches: each matched its record
    at every step and went non-finite at the failing step, and all agree on every row: the NaN record's row dropped
    (rank 1's row 2) is the confirmed fix, no learning rate or precision is."""
    found = _diagnoses(bundle, world)
    for rank, d in enumerate(found):
        assert d["verdict"] == "done"
        assert d["title"] == "Diagnosis in process: confirmed fix over the window: suspicious samples dropped", rank
        assert d["window"]["reproduced"] and d["window"]["first_departure"] is None, rank
        assert d["rows"] == found[0]["rows"]
        # the row named by the sample id the rank's check was given
        want = f"dropped rows [2] (r1-s{FAULT_STEP}-2) of rank 1's batch" if rank == FAULT_RANK else \
            f"dropped none of rank {rank}'s batch"
        assert d["drop"].startswith(want), d["drop"]
    assert [k for k, v in found[0]["rows"].items() if v == "confirmed fix"] == ["ablate:window:drop-suspicious"]


def test_ddp_every_rank_diagnoses_the_window_together(ddp):
    out, ranks = ddp
    _assert_diagnosed_together(load_bundle(_set_dir(out, "ddp-sync")), 4)
    for r in ranks:
        assert "diagnosis over the window in process: confirmed fix over the window: suspicious samples dropped" in \
            r["sync"]["error"]["message"]


def test_ddp_each_rank_keeps_its_own_window(ddp):
    """The run's window (nanscan.runtime.window) is kept per rank: each part holds its own rank's batches, and the
    state kept at step 0 (the same on every rank, as DDP keeps them)."""
    out, _ = ddp
    bundle = load_bundle(_set_dir(out, "ddp-sync"))
    kept = []
    for rank in range(4):
        part = bundle.part(rank)
        records = part.window_records()
        assert [r.step for r in records] == list(range(FAULT_STEP + 1))
        for r in records:
            want = make_batch(rank, r.step, "x")["x"]
            assert torch.equal(r.batch["x"].nan_to_num(7.0), want.nan_to_num(7.0)), (rank, r.step)
            assert r.sample_ids == sample_ids(rank, r.step)
        assert [s["step"] for s in part.window["states"]] == [0]
        kept.append(part.window_state(0)[0])
    assert all(torch.equal(kept[0][k], other[k]) for other in kept[1:] for k in kept[0])


def test_ddp_rewriting_the_same_incident_changes_nothing(ddp):
    out, ranks = ddp
    rerun = ranks[0]["rerun"]
    assert rerun["error"]["step"] == FAULT_STEP
    assert INDEX in rerun["hashes_before"] and "rank-3/manifest.json" in rerun["hashes_before"]
    assert rerun["hashes_after"] == rerun["hashes_before"]


def test_ddp_async_verdict_names_the_step_one_check_later(ddp):
    out, ranks = ddp
    run_ids = {results["async"]["run_id"] for results in ranks}
    assert len(run_ids) == 1  # rank 0's default run_id was broadcast
    set_dir = out / "bundles" / run_ids.pop() / f"step-{FAULT_STEP}"
    for rank, results in enumerate(ranks):
        r = results["async"]
        assert r["error_at"] == {"where": "check", "step": FAULT_STEP + 1}
        assert (r["error"]["step"], r["error"]["first_bad_ranks"], r["error"]["bad_ranks"]) == (FAULT_STEP, [1], [1])
        assert r["error"]["local_category"] == ("input" if rank == FAULT_RANK else OTHER_RANK)
        assert "after step 7's update" in r["error"]["message"]
        # every rank took the same branch at step 7 (agreed ok), so the replicas stayed identical
        assert r["ok"] == [True] * (FAULT_STEP + 1) and r["updated"] == list(range(FAULT_STEP + 1))
        assert r["local_ok"][FAULT_STEP] is (rank != FAULT_RANK)
    bundle = load_bundle(set_dir)
    written = {r: bundle.part(r).manifest["distributed"]["written"] for r in range(4)}
    assert written == {0: "one_step_late", 1: "at_check", 2: "one_step_late", 3: "one_step_late"}
    assert bundle.part(0).category == OTHER_RANK and bundle.category == "input"
    late = bundle.part(0).manifest
    assert "one step late" in late["state"]["note"] and late["rng"]["captured_at"] == "check"
    assert bundle.manifest["rng"]["captured_at"] == "step_start"  # rank 1 wrote at its own failing check
    assert [e.step for e in bundle.part(0).history()][-1] == FAULT_STEP


def test_ddp_skip_keeps_every_rank_in_lockstep(ddp):
    out, ranks = ddp
    states = [load_file(out / f"skip-rank{r}.safetensors") for r in range(4)]
    for rank, results in enumerate(ranks):
        r = results["skip"]
        assert r["error"] is None and r["finite"]
        assert r["ok"] == [step != FAULT_STEP for step in range(STEPS)]
        assert r["local_ok"][FAULT_STEP] is (rank != FAULT_RANK)
        assert r["updated"] == [s for s in range(STEPS) if s != FAULT_STEP]
        assert r["first_invalid_step"] == FAULT_STEP and r["bundle_path"].endswith(f"step-{FAULT_STEP}")
        assert len(r["warnings"]) == 1 and "rank 1 first" in r["warnings"][0]
        assert all(torch.equal(states[0][k], states[rank][k]) for k in states[0])


def test_ddp_every_rank_rolls_back_at_the_same_step(ddp):
    """on_invalid=Rollback(skip="step") (nanscan.runtime.rollback NOTE: [rollback]): the NaN in rank 1's batch at
    step 7 reaches every rank through the all-reduce; every rank drops that step's update, no rank hangs, all go on
    to the end in lockstep with the same weights, and one rollbacks.json records it."""
    out, ranks = ddp
    for r in ranks:
        result = r["rollback"]
        assert result["error"] is None and result["finite"]
        assert result["updated"] == [s for s in range(STEPS) if s != FAULT_STEP]
    states = [load_file(out / f"rollback-rank{r}.safetensors") for r in range(4)]
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])
    data = json.loads((out / "bundles" / "ddp-rollback" / "rollbacks.json").read_text())
    (entry,) = data["rollbacks"]
    assert (entry["at_step"], entry["skipped_steps"], entry["category"]) == (FAULT_STEP, [FAULT_STEP], "input")
    assert entry["outcome"] == {"status": "pending", "finite_steps": STEPS - FAULT_STEP - 1}  # as Monitor.close left it


def test_ddp_ranks_checking_different_steps_all_raise(ddp):
    _out, ranks = ddp
    for results in ranks:
        r = results["mismatch"]
        assert r["error"]["type"] == "RuntimeError" and r["error_at"]["step"] == 0
        assert "checked different steps" in r["error"]["message"]


def test_report_reads_the_whole_set(ddp):
    out, _ranks = ddp
    set_dir = _set_dir(out, "ddp-sync")
    result = CliRunner().invoke(main, ["report", str(set_dir), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["first_invalid_step"] == FAULT_STEP and summary["category"] == "input"
    ranks = summary["distributed"]
    assert ranks["first_bad_ranks"] == [1] and ranks["shown_rank"] == 1 and len(ranks["ranks"]) == 4
    text = CliRunner().invoke(main, ["report", str(set_dir), "--html", str(out / "report.html")])
    assert text.exit_code == 0, text.output
    assert "ranks at step 7" in text.output and "1 (first)" in text.output
    page = (out / "report.html").read_text()
    assert "1 (first)" in page and "host / device" in text.output
    # each rank's host and device, where a recurring machine shows (the ranks table, terminal and HTML)
    assert page.count(f"<td class=\"l\">{socket.gethostname()} / cpu</td>") == 4


def test_triage_counts_a_set_once_as_its_first_bad_rank(ddp):
    out, _ranks = ddp
    set_dir = _set_dir(out, "ddp-sync")
    result = triage(out / "bundles")
    assert not result.unreadable and not any("rank-" in e.path for e in result.entries)
    (entry,) = [e for e in result.entries if e.path == str(set_dir)]
    assert (entry.category, entry.step, entry.first_bad_ranks, entry.world_size) == ("input", FAULT_STEP, [1], 4)
    text = CliRunner().invoke(main, ["triage", str(out / "bundles")])
    assert text.exit_code == 0, text.output
    assert "1 of 4" in text.output


def test_damaged_sets_are_refused_with_a_clear_message(ddp, tmp_path):
    out, ranks = ddp
    copy = tmp_path / "set"
    shutil.copytree(_set_dir(out, "ddp-sync"), copy)
    shutil.rmtree(copy / "rank-2")
    shutil.copytree(_set_dir(out, ranks[0]["async"]["run_id"]) / "rank-2", copy / "rank-2")
    with pytest.raises(BundleError, match="does not belong to this set"):
        load_bundle(copy)
    (copy / INDEX).unlink()
    with pytest.raises(BundleError, match="no index.json: rank 0 did not finish"):
        load_bundle(copy)


def test_sets_with_linked_parts_or_index_are_refused(ddp, tmp_path):
    """A received set whose rank part or index is a symbolic link could make readers show files from anywhere."""
    out, _ = ddp
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(_set_dir(out, "ddp-sync") / "rank-2", elsewhere)
    linked = tmp_path / "linked-part"
    shutil.copytree(_set_dir(out, "ddp-sync"), linked)
    shutil.rmtree(linked / "rank-2")
    (linked / "rank-2").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(BundleError, match="rank-2 is a symbolic link"):
        load_bundle(linked)
    linked_index = tmp_path / "linked-index"
    shutil.copytree(_set_dir(out, "ddp-sync"), linked_index)
    (tmp_path / "index-elsewhere.json").write_bytes((linked_index / INDEX).read_bytes())
    (linked_index / INDEX).unlink()
    (linked_index / INDEX).symlink_to(tmp_path / "index-elsewhere.json")
    with pytest.raises(BundleError, match="is a symbolic link"):
        load_bundle(linked_index)


# -- FSDP2, 2 processes -----------------------------------------------------------------------------------------

def test_fsdp_every_rank_stops_and_shards_are_named_and_joined(fsdp):
    out, ranks = fsdp
    set_dir = _set_dir(out, "fsdp-sync")
    for rank, results in enumerate(ranks):
        r = results["sync"]
        assert r["error_at"] == {"where": "check", "step": FAULT_STEP}
        assert (r["error"]["step"], r["error"]["category"], r["error"]["first_bad_ranks"]) == (FAULT_STEP, "input", [1])
        assert r["updated"] == list(range(FAULT_STEP))
    bundle = load_bundle(set_dir)
    assert bundle.rank == FAULT_RANK and bundle.first_bad_ranks == [1] and bundle.bad_ranks == [0, 1]
    # each rank scanned its local shard under the global name and its shard index
    for rank in (0, 1):
        names = bundle.part(rank).history()[-1].report.names
        assert f"param:0.weight@shard{rank}/2" in names and f"optim:2.weight@shard{rank}/2.exp_avg" in names
        assert bundle.part(rank).manifest["distributed"]["sharded"]
    assert bundle.part(0).manifest["state"]["pre_step"]  # snapshot="cpu" copied the local shards
    # sharded weights cannot be rerun on one rank: the in-process rerun says so instead of hanging a collective
    for rank in (0, 1):
        (finding,) = [f for f in bundle.part(rank).findings() if f["key"] == "rerun"]
        assert finding["record"]["verdict"] == "not run" and "sharded across the ranks" in finding["record"]["reason"]
    # joined from both parts, the state is the full model and optimizer state (step 7's update never ran)
    full = load_file(out / "fsdp-sync-full.safetensors")
    model_state, optimizer_state = bundle.state()
    assert sorted(model_state) == sorted(k.removeprefix("model/") for k in full if k.startswith("model/"))
    for key, value in model_state.items():
        assert torch.equal(value, full[f"model/{key}"]), key
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            assert torch.equal(value, full[f"optimizer/{index}/{key}"]), (index, key)


def test_fsdp_on_one_rank_reruns_the_step_in_process(fsdp, tmp_path):
    """At world size 1 nothing is sharded across ranks: the rerun runs (issue 61: it said "the weights are sharded
    across the ranks")."""
    (result,) = _spawn(_fsdp_one_worker, 1, tmp_path)
    assert result["verdict"] == "reproduced", result


def test_fsdp_every_rank_diagnoses_the_window_together_from_its_shards(fsdp):
    out, _ranks = fsdp
    _assert_diagnosed_together(load_bundle(_set_dir(out, "fsdp-sync")), 2)


def test_fsdp_flush_decides_before_the_update_in_async_mode(fsdp):
    _out, ranks = fsdp
    for results in ranks:
        r = results["flush"]
        assert r["error_at"] == {"where": "flush", "step": FAULT_STEP}
        assert (r["error"]["step"], r["error"]["first_bad_ranks"]) == (FAULT_STEP, [1])
        assert "after step 7's update" not in r["error"]["message"]
        assert r["updated"] == list(range(FAULT_STEP))


def test_fsdp_set_replays_the_failing_rank_in_one_process(fsdp, tmp_path):
    from nanscan.replay import replay

    out, _ranks = fsdp
    result = replay(_set_dir(out, "fsdp-sync"), runs=1, bisect=False)
    assert result.reproduced and result.runs[0].category == "input"
    assert result.bundle.endswith("rank-1")
    lone = tmp_path / "rank-1"
    shutil.copytree(_set_dir(out, "fsdp-sync") / "rank-1", lone)
    with pytest.raises(BundleError, match="only rank 1's FSDP shards"):
        replay(lone, runs=1, bisect=False)


# -- one process in a group of one (no spawn) -------------------------------------------------------------------

@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _one_rank_run(mon: Monitor, model, optimizer, steps: int, fault_step: int):
    for step in range(steps):
        batch = make_batch(FAULT_RANK, step, "x" if step == fault_step else None)
        if step == fault_step:
            batch["x"][2, 1] = float("nan")
        loss = step_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if mon.check(batch=batch, loss=loss).ok:
            optimizer.step()


def test_close_acts_on_the_last_pending_verdict(world_of_one, tmp_path):
    model = make_model()
    optimizer = make_optimizer(model)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="last", agreement="async")
    _one_rank_run(mon, model, optimizer, steps=3, fault_step=2)
    assert mon.first_invalid_step is None  # the verdict of the last step is still on its way
    with pytest.raises(NonFiniteError) as caught:
        mon.close()
    assert caught.value.step == 2 and caught.value.bundle_path == tmp_path / "last" / "step-2"
    assert load_bundle(caught.value.bundle_path).part(0).manifest["distributed"]["written"] == "at_check"
    assert not model._forward_pre_hooks  # the hook is removed even though close raised


def test_monitor_arguments_are_checked(world_of_one, tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="agreement='later'"):
        Monitor(model, agreement="later")
    mon = Monitor(model, bundle_dir=tmp_path, run_id="alone", process_group=False)
    assert mon._agreement is None
    with pytest.raises(NonFiniteError) as caught:
        _one_rank_run(mon, model, make_optimizer(model), steps=2, fault_step=1)
    assert caught.value.bundle_path == tmp_path / "alone" / "step-1"  # an ordinary bundle, no rank part
    assert not isinstance(load_bundle(caught.value.bundle_path), BundleSet)


def test_process_group_without_torch_distributed_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        Monitor(make_model(), process_group=object())


def test_a_monitor_closed_by_an_exception_still_waits_for_its_last_collective(caplog):
    """A collective in flight when the process group is destroyed can abort the process (gloo), so discarding the
    unread async verdict waits for it, bounded; a failure there is logged, never raised over the loop's error."""
    from nanscan.runtime.distributed import DISCARD_WAIT, Agreement, _Pending

    class Work:
        def __init__(self, error=None):
            self.waited, self.error = [], error

        def wait(self, timeout=None):
            self.waited.append(timeout)
            if self.error:
                raise self.error
            return True

    agreement = Agreement.__new__(Agreement)
    for work in (Work(), Work(RuntimeError("connection closed"))):
        agreement._pending = _Pending(work, torch.zeros(4), 3, None, None, None, False)
        agreement.discard()
        assert work.waited == [DISCARD_WAIT] and agreement._pending is None
    assert "connection closed" in caplog.text
    agreement.discard()  # nothing pending: nothing to wait for
