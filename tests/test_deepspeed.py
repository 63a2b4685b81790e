"""DeepSpeed ZeRO-1, 2 and 3, and ZeRO-Offload at stages 2 and 3, on CPU (gloo, DS_ACCELERATOR=cpu, 2 ranks, bf16):
a NaN planted in one gradient element that only rank 1 holds is caught at that step as `gradient`, naming the parameter and rank 1's partition, on
every rank, with a bundle set that loads and reports; a NaN in rank 0's batch is `input` on rank 0; a healthy run
raises nothing. Against the real library: the planted NaN goes into DeepSpeed's own gradient partition.

One spawn of 2 processes per ZeRO stage (module fixture) runs the three scenarios in a row, each on a fresh engine;
the workers leave what they saw in JSON. A hung rank cannot hang the suite: gloo's collectives have a timeout, the
spawn is joined with a deadline and killed after it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from spawn_ranks import spawn

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: it picks its accelerator then
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nanscan[deepspeed]')")

from nanscan import load_bundle  # noqa: E402
from nanscan.bundle import BundleSet  # noqa: E402
from nanscan.cli.main import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
STEPS = 5
FAULT_STEP = 3
GRAD_PARAM = "2.weight"  # the NaN goes into the gradient of this parameter, in the partition rank 1 holds
FLIP_PARAM = "0.weight"
ROLLBACK_TO = 2  # the window keeps a state every 2 steps: the rollback at FAULT_STEP goes back to step 2's
DIVERGE_LR, DIVERGE_STEP = 0.5, 37  # the diverging run's rate, and the step its loss overflows at  # a bit of this bfloat16 weight is flipped on rank 1 (ZeRO-1/2 replicate it on every rank)
SPAWN_TIMEOUT_S = 200
COLLECTIVE_TIMEOUT = timedelta(seconds=90)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _config(stage: int, offload: bool = False) -> dict:
    # Small buckets and no parameter persistence, so that ZeRO-3 partitions every parameter of this small model.
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
                                    "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 64,
                                    "stage3_max_live_parameters": 1000}}
    if offload:  # ZeRO-Offload: gradients and optimizer state on the CPU, stepped by the torch optimizer given
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def _batch(rank: int, step: int, nan_input: bool) -> dict:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(4, 8, generator=g)
    if nan_input and rank == 0 and step == FAULT_STEP:
        x[1, 2] = float("nan")
    return {"x": x.to(torch.bfloat16), "y": torch.randn(4, 3, generator=g)}


def _plant_gradient_nan(engine, name: str) -> bool:
    """Write a NaN into DeepSpeed's gradient partition of parameter `name`, at an element this rank holds; False
    when this rank holds none of it. Through DeepSpeed's structures, not nanscan's: ZeRO-3 by its public local-grad
    API, ZeRO-1/2 through the parameter's fragment mapping (what safe_set_full_grad writes)."""
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    p = dict(engine.module.named_parameters())[name]
    if hasattr(p, "ds_id"):
        local = safe_get_local_grad(p)
        local.view(-1)[0] = float("nan")
        safe_set_local_grad(p, local)
        return True
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return False
    fragment = mapping.gradient_dict[mapping.param_group_index][p._index_in_param_group].view(-1)
    at = mapping.lp_fragment_address.start if fragment.numel() == p.numel() else 0
    fragment[at] = float("nan")
    return True


class _HookedNaN:
    """Offload: a NaN put into rank 1's own gradient of `name` by a tensor hook, before DeepSpeed reduces it, at an
    element of the partition rank 1 holds (its fragment under ZeRO-1/2, its slice of the flattened parameter
    under ZeRO-3), so that after the reduction the NaN is in rank 1's partition only; `armed` for one backward."""

    def __init__(self, engine, name: str, rank: int):
        p = dict(engine.module.named_parameters())[name]
        mapping = getattr(p, "_hp_mapping", None)
        self.at = p.partition_numel() * rank if hasattr(p, "ds_id") else \
            (mapping.lp_fragment_address.start if mapping is not None else None)
        self.armed = self.planted = False
        p.register_hook(self)

    def __call__(self, grad):
        if not self.armed or self.at is None or self.at >= grad.numel():
            return grad
        self.armed, self.planted = False, True
        grad = grad.clone()
        grad.view(-1)[self.at] = float("nan")
        return grad


def _flip_weight_bit(engine, name: str) -> None:
    """Flip the lowest mantissa bit of one element of the module's bfloat16 weight `name`, in DeepSpeed's own flat
    buffer (the parameter's data is a view of it): the value stays finite."""
    p = dict(engine.module.named_parameters())[name]
    with torch.no_grad():
        p.data.view(-1).view(torch.int16)[1] ^= 1


def _step_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]).float(), batch["y"])


def replay_entry(config: dict):
    """The model and optimizer as a replay entry builds them, without DeepSpeed."""
    from nanscan.entry import ReplaySpec

    return ReplaySpec(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _step_loss)


def _run(stage: int, rank: int, bundle_dir: Path, scenario: str, offload: bool = False) -> dict:
    """One scenario on a fresh engine: train STEPS steps under a DeepSpeedMonitor (on_invalid="raise"; for
    "streak", on_invalid="warn" and a NaN gradient at every step from step 1, which DeepSpeed's bf16 overflow check
    skips every time; for "flip", a weight bit flipped on rank 1 before step FAULT_STEP's forward). offload:
    ZeRO-Offload, whose gradients are planted through a hook (_HookedNaN), since DeepSpeed copies its partitions
    into the CPU masters' gradients only inside engine.step()."""
    import deepspeed

    from nanscan.integrations.deepspeed import DeepSpeedMonitor

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage, offload))
    streak = scenario == "streak"
    # the input scenario gives step_fn: the in-process rerun and diagnosis must say why they do not run, the
    # same way on every rank, and leave the bundles complete (no rank alone may run a ZeRO collective)
    mon = DeepSpeedMonitor(engine, bundle_dir=bundle_dir, run_id=f"zero{stage}-{scenario}",
                           on_invalid="warn" if streak else "raise", max_skips=2,
                           step_fn=_step_loss if scenario == "input" else None)
    record = {"error": None, "scanned_grads": [], "planted": False, "optimizer": type(engine.optimizer).__name__,
              "warnings": [], "replicas": mon._agreement.replicas}
    hooked = _HookedNaN(engine, GRAD_PARAM, rank) if offload and rank == 1 else None
    for step in range(STEPS):
        batch = _batch(rank, step, scenario == "input")
        if scenario == "flip" and rank == 1 and step == FAULT_STEP:
            _flip_weight_bit(engine, FLIP_PARAM)
        plant = rank == 1 and (scenario == "gradient" and step == FAULT_STEP or streak and step >= 1)
        if hooked is not None:
            hooked.armed = plant
        loss = torch.nn.functional.mse_loss(engine(batch["x"]).float(), batch["y"])
        engine.backward(loss)
        if hooked is not None:
            record["planted"] = record["planted"] or hooked.planted
        elif plant:
            record["planted"] = _plant_gradient_nan(engine, GRAD_PARAM)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                report = mon.check(batch=batch, loss=loss)
            record["warnings"] += [(step, type(w.message).__name__) for w in caught
                                   if w.category.__module__.startswith("nanscan")]
        except Exception as err:  # noqa: BLE001 - recorded, the test asserts on it
            record["error"] = {"type": type(err).__name__, "step": getattr(err, "step", None),
                               "category": getattr(err, "category", None), "tensors": getattr(err, "tensors", None),
                               "first_bad_ranks": getattr(err, "first_bad_ranks", None),
                               "local_category": getattr(err, "local_category", None),
                               "odd_ranks": getattr(err, "odd_ranks", None),
                               "bundle_path": str(getattr(err, "bundle_path", None)), "message": str(err)}
            break
        record["scanned_grads"].append(sum(name.startswith("grad:") for name in report.names))
        engine.step()
    mon.close()
    return record


def _digest(engine, counters: bool = True) -> str:
    """What the engine holds on this rank (its partitions, weights and optimizer state) and its step counters."""
    from nanscan.integrations.deepspeed import zero_tensors

    h = hashlib.sha256()
    for kind, name, t in zero_tensors(engine):
        if kind != "gradient":
            h.update(name.encode())
            h.update(t.detach().float().contiguous().numpy().tobytes())
    if counters:
        h.update(repr([engine.global_steps, engine.global_samples, engine.micro_steps,
                       engine.skipped_steps]).encode())
    return h.hexdigest()


def _rollback(stage: int, rank: int, bundle_dir: Path, offload: bool) -> dict:
    """A NaN in rank 1's gradient partition at FAULT_STEP under on_invalid=Rollback(skip="window"): every rank loads
    its partitions kept at step ROLLBACK_TO back into the engine (NOTE: [zero window]), the failing step's
    engine.step() updates nothing, and the run trains on, finite."""
    import deepspeed

    from nanscan import Rollback
    from nanscan.integrations.deepspeed import DeepSpeedMonitor
    from nanscan.runtime.window import Window

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=_config(stage, offload))
    mon = DeepSpeedMonitor(engine, bundle_dir=bundle_dir, run_id=f"zero{stage}-rollback",
                           on_invalid=Rollback(skip="window"), window=Window(steps=4, every=ROLLBACK_TO))
    hooked = _HookedNaN(engine, GRAD_PARAM, rank) if offload and rank == 1 else None
    record = {"error": None, "starts": [], "warnings": [], "losses": []}
    for step in range(STEPS + 3):
        record["starts"].append(_digest(engine, counters=False))
        batch = _batch(rank, step, False)
        plant = rank == 1 and step == FAULT_STEP
        if hooked is not None:
            hooked.armed = plant
        loss = _step_loss(engine, batch)
        engine.backward(loss)
        if plant and hooked is None:
            _plant_gradient_nan(engine, GRAD_PARAM)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mon.check(batch=batch, loss=loss)
            record["warnings"] += [(step, type(w.message).__name__) for w in caught
                                   if w.category.__module__.startswith("nanscan")]
        except Exception as err:  # noqa: BLE001 - recorded, the test asserts on it
            record["error"] = f"{type(err).__name__}: {err}"
            break
        record["losses"].append(float(loss.detach()))
        engine.step()
    mon.close()
    return record




def _diverge(stage: int, rank: int, bundle_dir: Path, offload: bool) -> dict:
    """The learning rate too large for a linear layer, with DeepSpeed's clipping off: the loss grows every step until
    it overflows (step DIVERGE_STEP); step_fn and a window from step 0 let every rank diagnose it in process (NOTE:
    [zero window])."""
    import deepspeed

    from nanscan.integrations.deepspeed import DeepSpeedMonitor
    from nanscan.runtime.window import Window

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 3))
    config = {**_config(stage, offload), "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=DIVERGE_LR),
                                      config=config)
    mon = DeepSpeedMonitor(engine, bundle_dir=bundle_dir, run_id=f"zero{stage}-diverge", on_invalid="raise",
                           step_fn=_step_loss, window=Window(steps=40, every=20))
    record = {"error": None, "before": None, "after": None}
    for step in range(DIVERGE_STEP + 5):
        g = torch.Generator().manual_seed(100 * rank + step)
        batch = {"x": (3 * torch.randn(4, 8, generator=g)).to(torch.bfloat16), "y": torch.randn(4, 3, generator=g)}
        loss = _step_loss(engine, batch)
        engine.backward(loss)
        record["before"] = _digest(engine)
        try:
            mon.check(batch=batch, loss=loss)
        except Exception as err:  # noqa: BLE001 - recorded, the test asserts on it
            record["after"] = _digest(engine)
            record["error"] = {"step": getattr(err, "step", None), "message": str(err),
                               "bundle_path": str(getattr(err, "bundle_path", None))}
            record["diagnosis"] = mon.diagnosis.to_dict() if mon.diagnosis is not None else None
            break
        engine.step()
    mon.close()
    return record


def _accumulated(rank: int, bundle_dir: Path) -> dict:
    """gradient_accumulation_steps=2 with step_fn: the window holds each step's boundary batch only, so the
    diagnosis says on every rank why it does not run."""
    import deepspeed

    from nanscan.integrations.deepspeed import DeepSpeedMonitor

    model = _model()
    config = {**_config(2), "gradient_accumulation_steps": 2}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    mon = DeepSpeedMonitor(engine, bundle_dir=bundle_dir, run_id="zero2-accumulated", on_invalid="raise",
                           step_fn=_step_loss)
    record = {"error": None}
    for step in range(FAULT_STEP + 1):  # the NaN in rank 0's boundary batch of step FAULT_STEP
        for micro in range(2):
            batch = _batch(rank, step, nan_input=micro == 1)
            engine.backward(_step_loss(engine, batch))
            if engine.is_gradient_accumulation_boundary():
                try:
                    mon.check(batch=batch)
                except Exception as err:  # noqa: BLE001 - recorded, the test asserts on it
                    record["error"] = {"step": getattr(err, "step", None), "message": str(err)}
                    record["diagnosis"] = mon.diagnosis.to_dict() if mon.diagnosis is not None else None
                    mon.close()
                    return record
            engine.step()
    mon.close()
    return record


def _worker(rank: int, variant: tuple, store: str, out: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)  # two processes share 2 cores
    import deepspeed
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=COLLECTIVE_TIMEOUT)
    deepspeed.init_distributed(dist_backend="gloo")
    stage, offload = variant
    results = {scenario: _run(stage, rank, Path(out) / "bundles", scenario, offload)
               for scenario in ("healthy", "gradient", "input", "streak") + (("flip",) if stage < 3 else ())}
    results["diverge"] = _diverge(stage, rank, Path(out) / "bundles", offload)
    results["rollback"] = _rollback(stage, rank, Path(out) / "bundles", offload)
    if variant == (2, False):
        results["accumulated"] = _accumulated(rank, Path(out) / "bundles")
    results["plain_monitor"] = _plain_monitor_refuses_an_engine(stage)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))


def _plain_monitor_refuses_an_engine(stage: int) -> str:
    import deepspeed

    from nanscan import Monitor

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=_config(stage))
    try:
        Monitor(engine, process_group=False)
    except TypeError as err:
        return str(err)
    return ""


@pytest.fixture(scope="module", params=[(1, False), (2, False), (3, False), (2, True), (3, True)],
                ids=lambda v: f"zero{v[0]}" + ("-offload" if v[1] else ""))
def zero(request, tmp_path_factory):
    stage, offload = request.param
    out = tmp_path_factory.mktemp(f"zero{stage}")
    spawn(_worker, request.param, WORLD, out, timeout_s=SPAWN_TIMEOUT_S, label=f"ZeRO-{stage} offload={offload}")
    return stage, out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_a_healthy_bf16_run_raises_nothing_and_scans_gradients_on_every_rank(zero):
    stage, _, ranks = zero
    for rank, results in enumerate(ranks):
        healthy = results["healthy"]
        assert healthy["error"] is None, (stage, rank, healthy["error"])
        assert len(healthy["scanned_grads"]) == STEPS
        assert min(healthy["scanned_grads"]) > 0, f"ZeRO-{stage} rank {rank} scanned no gradient"


def test_a_gradient_nan_on_rank_1_is_caught_at_its_step_on_every_rank(zero):
    stage, out, ranks = zero
    assert ranks[1]["gradient"]["planted"], f"rank 1 holds no element of {GRAD_PARAM} under ZeRO-{stage}"
    expected = f"grad:{GRAD_PARAM}@shard1/{WORLD}"
    for rank, results in enumerate(ranks):
        error = results["gradient"]["error"]
        assert error is not None, f"ZeRO-{stage} rank {rank} did not stop"
        assert error["type"] == "DistributedNonFiniteError"
        assert error["step"] == FAULT_STEP and error["category"] == "gradient"
        assert error["tensors"] == [expected], error
        assert error["first_bad_ranks"] == [1]
        assert error["local_category"] == ("gradient" if rank == 1 else "other_rank")
    bundle = load_bundle(Path(ranks[0]["gradient"]["error"]["bundle_path"]))
    assert isinstance(bundle, BundleSet)
    assert bundle.index["first_bad_ranks"] == [1] and bundle.index["category"] == "gradient"
    assert bundle.manifest["category_tensors"] == [expected]
    # the part holds what rank 1 held: its fp32 master fragment of the parameter, under the scanned name
    model_state, optimizer_state = bundle.state()
    assert optimizer_state["zero_stage"] == stage
    master = optimizer_state["fragments"][f"{GRAD_PARAM}@shard1/{WORLD}.master"]
    assert master.dtype == torch.float32 and master.numel() > 0 and bool(torch.isfinite(master).all())
    weight = model_state[f"{GRAD_PARAM}@shard1/{WORLD}" if stage == 3 else GRAD_PARAM]
    assert weight.numel() > 0
    result = CliRunner().invoke(main, ["report", str(Path(ranks[0]["gradient"]["error"]["bundle_path"]))])
    assert result.exit_code == 0, result.output
    assert GRAD_PARAM in result.output


def test_zero12_compares_the_replicated_low_precision_weights_and_catches_a_flipped_bit(zero):
    """NOTE: [replica agreement]: under ZeRO-1/2 every rank holds the whole bfloat16 weights, which the healthy run
    compares at every step without an alarm; a mantissa bit flipped in rank 1's copy (still finite) stops both ranks
    at that step as replica_mismatch naming the weight (2 replicas: both named). ZeRO-3 partitions everything and
    compares nothing."""
    stage, out, ranks = zero
    for rank, results in enumerate(ranks):
        assert results["healthy"]["replicas"] is (stage < 3)
        if stage == 3:
            assert "flip" not in results
            continue
        error = results["flip"]["error"]
        assert error is not None and error["type"] == "ReplicaMismatchError", (stage, rank, error)
        assert (error["step"], error["category"], error["odd_ranks"]) == (FAULT_STEP, "replica_mismatch", [0, 1])
        assert error["tensors"] == [f"param:{FLIP_PARAM}"], error
        assert "cannot tell which" in error["message"]
    if stage < 3:
        index = load_bundle(Path(ranks[0]["flip"]["error"]["bundle_path"])).index
        replicas = index["replicas"]
        assert replicas["groups"] == ["parameter"] and replicas["gradients_compared"] is False
        assert "none is replicated" in replicas["cause"]


def test_a_nan_in_rank_0s_batch_is_an_input_incident_of_rank_0(zero):
    stage, _, ranks = zero
    for rank, results in enumerate(ranks):
        error = results["input"]["error"]
        assert error is not None and error["step"] == FAULT_STEP, (stage, rank, error)
        assert error["category"] == "input" and error["tensors"] == ["input:x"]
        assert error["first_bad_ranks"] == [0]


def test_step_fn_under_zero_diagnoses_a_nan_record_on_every_rank_and_the_bundles_are_complete(zero):
    """Monitor(step_fn=...) under DeepSpeed (nanscan.runtime.incident_diagnosis NOTE: [in-process diagnosis]): no
    rank reruns the failing step alone inside ZeRO's collectives (said, with the reason), every rank reruns the
    window together from its kept partitions and confirms dropping the record with the NaN, and nothing else; the
    loop's own clipping (DeepSpeed's default, 1.0) is not offered as a fix; the set loads whole."""
    stage, out, ranks = zero
    bundle = load_bundle(Path(ranks[0]["input"]["error"]["bundle_path"]).parent)
    verdicts = []
    for rank in range(WORLD):
        part = bundle.part(rank)
        findings = {f["key"]: f["record"] for f in part.findings()}
        diagnosis = findings["diagnosis"]
        assert diagnosis["verdict"] == "done", (stage, rank, diagnosis)
        rows = {row["factor"]: row for row in diagnosis["ablation"]["rows"]}
        assert [key for key, row in rows.items() if row["verdict"] == "confirmed fix"] == ["drop-suspicious"]
        assert rows["clip-1.0"]["verdict"] == "not applied" and "already clips" in rows["clip-1.0"]["detail"]
        verdicts.append(sorted((key, row["verdict"]) for key, row in rows.items()))
        if "rerun" in findings:  # the rank whose own batch went bad
            assert findings["rerun"]["verdict"] == "not run" and "DeepSpeed" in findings["rerun"]["reason"]
        assert part.manifest["rerun"]["step_fn"].endswith("_step_loss")
    assert verdicts[0] == verdicts[1]
    assert all("diagnosis over the window in process: confirmed fix over the window: suspicious samples dropped"
               in r["input"]["error"]["message"] for r in ranks)


def test_replay_of_a_zero_set_says_what_it_holds_and_what_reads_it(zero):
    """`nanscan replay` of a ZeRO set in one process: refused with the stage, what a rank's state is and what reads
    it, not a list of missing keys (issue 62)."""
    stage, _out, ranks = zero
    bundle = str(Path(ranks[0]["gradient"]["error"]["bundle_path"]).parent)
    result = CliRunner().invoke(main, ["replay", bundle, "--entry", f"{Path(__file__).stem}:replay_entry",
                                       "--runs", "1", "--no-bisect", "--no-record"])
    assert result.exit_code != 0
    assert f"holds a DeepSpeed ZeRO-{stage} rank's state" in result.output and "nanscan report" in result.output
    assert "missing" not in result.output.lower() and "unexpected" not in result.output.lower()


def test_a_streak_of_steps_deepspeed_skips_warns(zero):
    """bf16 has no loss scale: the first NaN gradient is an incident (warned), and DeepSpeed's overflow check then
    skips that step and every later one, which the skip streak warning says after max_skips=2 of them."""
    _, _, ranks = zero
    for rank, results in enumerate(ranks):
        seen = [tuple(w) for w in results["streak"]["warnings"]]
        assert (1, "NonFiniteWarning") in seen, (rank, seen)
        assert [step for step, kind in seen if kind == "DeepSpeedSkipWarning"] == [3], (rank, seen)


def test_a_plain_monitor_refuses_an_engine_and_names_the_adapter(zero):
    _, _, ranks = zero
    assert "DeepSpeedMonitor" in ranks[0]["plain_monitor"]


def test_import_nanscan_does_not_import_deepspeed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, nanscan, nanscan.runtime.monitor, nanscan.integrations\nprint('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         timeout=120).stdout
    assert out.split()[-1] == "False"


def test_every_rank_diagnoses_a_learning_rate_too_large_over_its_window_and_gets_its_engine_back(zero):
    """DeepSpeed keeps a window of its partitions (NOTE: [zero window]): at the overflow every rank reruns the
    window from its own kept partitions through engine.backward/engine.step (NOTE: [step driver]), matching the
    record at every step, confirms the lower learning rate (and DeepSpeed's clipping, which the run turned off),
    says the engine fixes the precision, and leaves the engine as it was: partitions, optimizer state and
    counters."""
    stage, out, ranks = zero
    verdict_rows = []
    bundle = load_bundle(Path(ranks[0]["diverge"]["error"]["bundle_path"]).parent)
    assert bundle.window["states"][0]["step"] == 0
    for rank, results in enumerate(ranks):
        run = results["diverge"]
        assert run["error"] is not None and run["error"]["step"] == DIVERGE_STEP, (stage, rank, run["error"])
        assert run["after"] == run["before"], f"ZeRO-{stage} rank {rank}: the diagnosis changed the engine"
        diagnosis = run["diagnosis"]
        assert diagnosis["verdict"] == "done", (stage, rank, diagnosis)
        window = {f["key"]: f["record"] for f in bundle.part(rank).findings()}["replay:window"]
        assert window["start"] == 0 and [s["step"] for s in window["steps"]] == list(range(DIVERGE_STEP + 1))
        assert window["first_departure"] is None and window["first_nonfinite"] == DIVERGE_STEP, window["headline"]
        verdicts = {row["factor"]: row for row in diagnosis["ablation"]["rows"]}
        assert verdicts["lr-x0.1"]["verdict"] == "confirmed fix" and verdicts["clip-1.0"]["verdict"] == "confirmed fix"
        precision = [verdicts[name] for name in ("bf16-autocast", "fp16-autocast")]
        assert all(row["verdict"] == "not applied" and "DeepSpeed's engine sets the precision" in row["detail"]
                   for row in precision), precision
        assert "learning rate x0.1" in run["error"]["message"]
        verdict_rows.append(sorted((name, row["verdict"]) for name, row in verdicts.items()))
    assert verdict_rows[0] == verdict_rows[1]  # the ranks agree on every row


def test_accumulation_inside_deepspeed_says_on_every_rank_why_the_window_is_not_rerun(zero):
    stage, _out, ranks = zero
    if "accumulated" not in ranks[0]:
        pytest.skip("run once, under ZeRO-2")
    reasons = set()
    for results in ranks:
        run = results["accumulated"]
        assert run["error"] is not None and run["diagnosis"]["verdict"] == "not run", run
        reasons.add(run["diagnosis"]["reason"])
    assert len(reasons) == 1 and "accumulates 2 micro-batches a step" in reasons.pop()


def test_a_rollback_loads_every_ranks_kept_partitions_back_and_the_run_trains_on(zero):
    """on_invalid=Rollback under ZeRO (issue 62 item 3): at the NaN every rank loads the partitions it kept at step
    ROLLBACK_TO back into DeepSpeed's buffers, the failing step's engine.step() applies nothing, and the next step
    starts from the kept state bit for bit; the run then trains to its end, finite, with no other incident (under
    ZeRO-1/2 the replicated weights still agree at every check)."""
    stage, _out, ranks = zero
    for rank, results in enumerate(ranks):
        run = results["rollback"]
        assert run["error"] is None, (stage, rank, run["error"])
        assert ("RollbackWarning" in {kind for step, kind in run["warnings"] if step == FAULT_STEP}), run["warnings"]
        assert not [w for w in run["warnings"] if w[0] != FAULT_STEP and w[1] != "RollbackWarning"], run["warnings"]
        starts = run["starts"]
        assert starts[FAULT_STEP + 1] == starts[ROLLBACK_TO] != starts[FAULT_STEP], (stage, rank)
        assert len(run["losses"]) == STEPS + 3 and all(math.isfinite(x) for x in run["losses"])
