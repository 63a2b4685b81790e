"""Where an overflow began (nanscan.runtime.localize NOTE: [overflow onset]): the first module whose output grew
overflow-sized from inputs that were not is named beside the first module with a non-finite output, which may
come much later; a jump of many binades counts too; a healthy step names none."""

from __future__ import annotations

import torch

import nanogpt_runs as N
from nanscan.runtime.localize import JUMP_BINADES, Localizer
from nanscan.runtime.rerun import run_step


def gpt(scale: float | None = None, dtype: str = "float32"):
    c = N.full_config({"dtype": dtype})
    model = N.build_model(c)
    if scale is not None:  # a bug in one block: its MLP's output multiplied by `scale`
        model.transformer.h[1].mlp.register_forward_hook(lambda module, args, out: out * scale)
    return model, N.configure_optimizer(model, c), N.get_batch(c, 0, 0)


def test_the_block_that_made_the_overflow_is_named_before_the_layer_that_went_nan():
    model, optimizer, batch = gpt(1e38)
    outcome = run_step(model, optimizer, N.step_fn, batch, localize=True)
    where = outcome.localization
    assert (where.phase, where.module) == ("forward", "transformer.ln_f")
    began = where.overflow_began
    assert began is not None and began.module == "transformer.h.1.mlp"
    assert began.received.absmax < 8 and began.produced.absmax > 2.0 ** 64
    text = where.describe()
    assert text.startswith("transformer.h.1.mlp (MLP) made 9.") and "then transformer.ln_f (LayerNorm)" in text
    assert where.to_dict()["overflow_began"]["module"] == "transformer.h.1.mlp"


def test_a_jump_of_many_binades_below_the_overflow_limit_is_named_too():
    model, _, batch = gpt(2.0 ** 24)  # the MLP's output (about 0.1) to about 1e6: below 2**64, 19 binades up
    with Localizer(model) as localizer:
        N.step_fn(model, batch)
    began = localizer.first_overflow
    assert began is not None and began.module == "transformer.h.1.mlp"
    assert began.produced.absmax < 2.0 ** 64 and "binades above their product" in began.detail
    assert int(began.detail.split(": ")[1].split(" binades")[0]) >= JUMP_BINADES


def test_a_healthy_step_names_no_overflow():
    model, _, batch = gpt()
    with Localizer(model) as localizer:
        N.step_fn(model, batch)
    assert localizer.first_overflow is None and localizer.first_forward is None
