"""A real PEFT LoRA model (a tiny GPT-2 built from its config, nothing downloaded): its frozen base is carried
between checks with records equal to a fresh scan's (nanscan.engine.plans NOTE: [frozen records]), and its bundle
references every frozen weight by sha256 (nanscan.bundle.frozen NOTE: [frozen references])."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from integration_models import VOCAB, tiny_gpt2

from nanscan.bundle import load_bundle
from nanscan.bundle.frozen import tensor_sha256
from nanscan.runtime.monitor import Monitor, NonFiniteError
from nanscan.engine.plans import BatchPlan, ModelScanPlan

peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")


def lora_gpt2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True,
                                                             task_type="CAUSAL_LM"))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def test_a_lora_gpt2s_frozen_base_is_carried_and_referenced(native, tmp_path):
    model, optimizer = lora_gpt2()
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="cpu", post_update=False)
    g = torch.Generator().manual_seed(0)
    adapter = next(p for n, p in model.named_parameters() if "lora_B" in n)
    for i in range(6):
        tokens = torch.randint(0, VOCAB, (2, 8), generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if i == 5:
            adapter.grad[0, 0] = float("nan")
        fresh = ModelScanPlan().launch(model, optimizer, extra=BatchPlan().prepare({"input_ids": tokens}, loss),
                                       backend_for=mon.backend_for)
        try:
            report = mon.check(batch={"input_ids": tokens}, loss=loss)
        except NonFiniteError as exc:
            bundle = load_bundle(exc.bundle_path)
            break
        assert np.array_equal(np.array(report.records), np.array(fresh.records()))
        optimizer.step()
    else:
        pytest.fail("the NaN planted in a LoRA gradient was not caught")
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert len(mon._plan._frozen) == len(frozen) and mon._plan.frozen_rescans == 1
    references = bundle.frozen_references()
    assert set(frozen) <= set(references)  # and the tied lm_head.weight under its own key
    assert all(references[n]["sha256"] == tensor_sha256(p) for n, p in frozen.items())
    assert not set(references) & set(bundle.state()[0])
    assert bundle.category == "gradient"
