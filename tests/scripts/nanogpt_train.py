"""A training script in the style of karpathy's nanoGPT `train.py`: the model, the optimizer and the data are
module-level globals and running the file trains (it cannot be imported for a replay entry). The loop sets the
learning rate each iteration, accumulates NANOGPT_ACCUM micro-batches (each loss divided by their count), runs the
forward under bf16 autocast on the CPU, prefetches the next micro-batch before backward() as nanoGPT does, hands
every micro-batch but the last to Monitor.observe() and checks after the last, clips at 1.0 after the check, and
gives the Monitor its forward as step_fn, with no replay entry.

NANOGPT_FAULT plants one fault at iteration NANOGPT_AT: "overflow" (block 1's MLP output multiplied by 1e38 by a
forward hook, from that iteration on), "ignored" (every target of micro-batch 0 set to -1, the loss's ignore index),
"grad_hook" (a one-shot tensor hook writes a NaN into one gradient during that iteration's backward), or "" (none).
The outcome goes to the JSON file NANOGPT_OUT: the failing step, the bundle and the error's message, the iterations
run, the in-process rerun's verdict, and a digest of the final weights and optimizer state and of the RNG state.
NANOGPT_POLICY sets on_invalid (default "raise"), NANOGPT_DROPOUT the dropout, NANOGPT_STEP_FN=0 leaves step_fn out.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nanogpt_runs import BASE, build_model, configure_optimizer, get_batch, get_lr  # noqa: E402

from nanscan import Monitor, NonFiniteError  # noqa: E402

FAULT = os.environ.get("NANOGPT_FAULT", "")
FAULT_AT = int(os.environ.get("NANOGPT_AT", "6"))
OUT = Path(os.environ["NANOGPT_OUT"])
c = {**BASE, "accum": int(os.environ.get("NANOGPT_ACCUM", "4")), "learning_rate": 1e-3,
     "dropout": float(os.environ.get("NANOGPT_DROPOUT", "0"))}
max_iters = int(os.environ.get("NANOGPT_ITERS", "12"))

model = build_model(c)
optimizer = configure_optimizer(model, c)
ctx = torch.autocast("cpu", dtype=torch.bfloat16)
blowup = [1.0]
model.transformer.h[1].mlp.register_forward_hook(lambda module, args, out: out * blowup[0])


def forward(model, batch):
    """The loop's forward, as step_fn: the loss of one micro-batch (autocast is the Monitor's to re-enter)."""
    _, loss = model(batch["x"], batch["y"])
    return loss


mon = Monitor(model, optimizer, bundle_dir=OUT.parent / "bundles", run_id="script",
              step_fn=forward if os.environ.get("NANOGPT_STEP_FN", "1") == "1" else None,
              on_invalid=os.environ.get("NANOGPT_POLICY", "raise"))


def fetch(it, micro):
    b = get_batch(c, it, micro)
    if FAULT == "ignored" and it == FAULT_AT and micro == 0:
        b["y"] = torch.full_like(b["y"], -1)
    return b


outcome = {"step": None, "bundle": None, "message": None, "iters": 0}
batch = fetch(0, 0)
try:
    for it in range(max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, c)
        if FAULT == "overflow" and it == FAULT_AT:
            blowup[0] = 1e38
        if FAULT == "grad_hook" and it == FAULT_AT:
            def poison(grad):
                handle.remove()  # one shot: it fires in this backward only
                grad = grad.clone()
                grad[0, 0] = float("nan")
                return grad
            handle = model.transformer.h[0].mlp.c_fc.weight.register_hook(poison)
        for micro in range(c["accum"]):
            with ctx:
                _, loss = model(batch["x"], batch["y"])
                loss = loss / c["accum"]
            current = batch
            last = micro == c["accum"] - 1
            batch = fetch(it + 1, 0) if last else fetch(it, micro + 1)  # prefetch, as nanoGPT does
            loss.backward()
            if last:
                report = mon.check(batch=current, loss=loss)
            else:
                mon.observe(batch=current, loss=loss)
        if report.ok:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        outcome["iters"] = it + 1
except NonFiniteError as exc:
    outcome.update(step=exc.step, bundle=str(exc.bundle_path), message=str(exc))
digest = hashlib.sha256()
for t in [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values())]:
    digest.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
outcome.update(digest=digest.hexdigest(), rerun=mon.rerun.verdict if mon.rerun is not None else None,
               rng=hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())
OUT.write_text(json.dumps(outcome))
