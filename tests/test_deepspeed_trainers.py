"""DeepSpeed under the trainers' own plugins (2 CPU ranks, gloo, DS_ACCELERATOR=cpu, ZeRO-2, bf16): the Hugging Face
Trainer with TrainingArguments(deepspeed=...) and NanscanCallback, and a hand-written accelerate loop with
accelerate's DeepSpeedPlugin and nanscan.integrations.accelerate.monitor, both scan the engine's ZeRO partitions
(nanscan.integrations.deepspeed), stay silent on a healthy run and stop at the step whose gradient a rank made NaN,
on every rank. Against the real libraries, small models built from config, nothing downloaded."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from spawn_ranks import spawn

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: it picks its accelerator then
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nanscan[deepspeed]')")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from nanscan import load_bundle  # noqa: E402

WORLD = 2
STEPS = 4
FAULT_STEP = 2  # the update (0-based) whose gradient rank 1 makes NaN
SPAWN_TIMEOUT_S = 240

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]


def _ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096}}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))


def _data(rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(rank)
    return [{"input_ids": torch.randint(0, 64, (16,), generator=g), "labels": torch.randint(0, 64, (16,), generator=g)}
            for _ in range(4 * STEPS)]


class _Planter:
    """A gradient hook on one weight of rank 1: NaN in its gradient at the FAULT_STEP-th backward (before
    DeepSpeed's own hooks reduce it into the partitions)."""

    def __init__(self, model, rank: int, enabled: bool):
        self.calls = 0
        self.planted = False
        if enabled and rank == 1:
            model.transformer.h[0].mlp.c_fc.weight.register_hook(self)

    def __call__(self, grad):
        self.calls += 1
        if self.calls == FAULT_STEP + 1:
            self.planted = True
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad


def _error(err: BaseException | None) -> dict | None:
    if err is None:
        return None
    return {"type": type(err).__name__, "step": getattr(err, "step", None), "category": getattr(err, "category", None),
            "bundle": str(getattr(err, "bundle_path", None)), "message": str(err)[:400]}


def _hf_run(rank: int, out: Path, fault: bool) -> dict:
    from transformers import Trainer, TrainingArguments

    from nanscan import NonFiniteError
    from nanscan.integrations.transformers import NanscanCallback

    model = _gpt2()
    planter = _Planter(model, rank, fault)
    callback = NanscanCallback(bundle_dir=out / "bundles", run_id=f"hf-{fault}")
    args = TrainingArguments(output_dir=str(out / f"hf-{rank}"), deepspeed=_ds_config(), bf16=True, use_cpu=True,
                             per_device_train_batch_size=4, max_steps=STEPS, report_to=[], logging_steps=1,
                             save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_data(rank), callbacks=[callback])
    error = None
    try:
        trainer.train()
    except NonFiniteError as err:
        error = err
    monitor = callback.monitor
    last = monitor.history[-1].report if monitor.history else None
    return {"error": _error(error), "planted": planter.planted, "monitor": type(monitor).__name__,
            "grads": sum(n.startswith("grad:") for n in last.names) if last else 0,
            "logged": [sorted(k for k in h if k.startswith("nanscan")) for h in trainer.state.log_history[:1]]}


def _accelerate_run(rank: int, out: Path, fault: bool) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from nanscan import NonFiniteError
    from nanscan.integrations.accelerate import monitor as nanscan_monitor

    config = dict(_ds_config(), train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    config["bf16"] = {"enabled": True}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _gpt2()
    planter = _Planter(model, rank, fault)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    mon = nanscan_monitor(accelerator, model, optimizer, bundle_dir=out / "bundles", run_id=f"acc-{fault}")
    data = _data(rank)
    error = None
    try:
        for step in range(STEPS):
            batch = {k: torch.stack([d[k] for d in data[4 * step: 4 * step + 4]]) for k in ("input_ids", "labels")}
            loss = model(**batch).loss
            accelerator.backward(loss)
            mon.check(batch=batch, loss=loss)
            optimizer.step()
            optimizer.zero_grad()
    except NonFiniteError as err:
        error = err
    last = mon.monitor.history[-1].report if mon.monitor.history else None
    mon.close()
    return {"error": _error(error), "planted": planter.planted, "monitor": type(mon.monitor).__name__,
            "grads": sum(n.startswith("grad:") for n in last.names) if last else 0}


def _worker(rank: int, runs: tuple, store: str, out: str) -> None:
    """The runs (trainer, fault) on fresh models. A process holds one accelerate state, whose DeepSpeed plugin and
    engine its first Accelerator fixes: the Trainer's two runs share one, each accelerate run has its own spawn."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=90))
    deepspeed.init_distributed(dist_backend="gloo")
    out = Path(out)
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for trainer, fault in runs:
            results[f"{trainer}-{fault}"] = (_hf_run if trainer == "hf" else _accelerate_run)(rank, out, fault)
            dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    found = [{}, {}]
    for runs in ((("hf", False), ("hf", True)), (("accelerate", False),), (("accelerate", True),)):
        out = tmp_path_factory.mktemp("ds-trainers")
        spawn(_worker, runs, WORLD, out, timeout_s=SPAWN_TIMEOUT_S, label=f"DeepSpeed runs {runs}")
        for r in range(WORLD):
            found[r].update(json.loads((out / f"rank{r}.json").read_text()))
    return found


@pytest.mark.parametrize("trainer", ["hf", "accelerate"])
def test_a_healthy_deepspeed_run_under_the_plugin_scans_the_partitions_and_raises_nothing(ranks, trainer):
    for results in ranks:
        r = results[f"{trainer}-False"]
        assert r["error"] is None and r["monitor"] == "DeepSpeedMonitor"
        assert r["grads"] > 0  # the ZeRO gradient partitions, not the empty p.grad
    if trainer == "hf":
        assert all("nanscan/nonfinite_steps" in ranks[0]["hf-False"]["logged"][0] for _ in [0])


@pytest.mark.parametrize("trainer, step", [("hf", FAULT_STEP + 1), ("accelerate", FAULT_STEP)])
def test_a_gradient_made_nan_on_one_rank_stops_every_rank_at_its_step(ranks, trainer, step):
    # the HF Trainer numbers an update as its log does (global_step + 1); the accelerate loop from 0
    assert ranks[1][f"{trainer}-True"]["planted"]
    for results in ranks:
        err = results[f"{trainer}-True"]["error"]
        assert err is not None and err["type"] == "DistributedNonFiniteError", err
        assert (err["step"], err["category"]) == (step, "gradient")
        assert "on rank 1 first (gradient: grad:transformer.h.0.mlp.c_fc.weight@shard" in err["message"]
    bundle = load_bundle(Path(ranks[0][f"{trainer}-True"]["error"]["bundle"]))
    assert bundle.index["first_bad_ranks"] == [1] and bundle.index["category"] == "gradient"
    assert bundle.step == step
