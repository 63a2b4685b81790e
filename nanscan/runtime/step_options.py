"""The options a rerun training step runs under (StepOptions), the factors one ablation changes them by (Factor,
FACTORS) and the precisions by name, free of torch: the Monitor's in-process rerun (nanscan.runtime.rerun) and replay's (nanscan.replay) run
the step under them, and the subcommands' help shows them without importing torch (NOTE: [fast help] in
nanscan/cli/main.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The precisions a rerun step can run in: "float32" turns autocast off, the others autocast to that dtype.
PRECISION_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class StepOptions:
    """How a rerun step differs from the recorded one (the ablation factors), all off by default.

    lr_scale: multiplies every param group's learning rate. precision: None (as recorded: the run's autocast region
    re-applied around step_fn, NOTE: [replayed precision] in nanscan/runtime/rerun.py), "float32" (weights and batch
    in float32, autocast off), "bfloat16" or "float16" (float32 weights, torch.autocast to that dtype).
    clip_grad_norm: clip the total gradient norm before optimizer.step(). deterministic: torch's deterministic
    algorithms (warn-only where an operation has none) and deterministic cuDNN. eps: the optimizer's eps in every
    param group that has one (Adam's, where an update trap points at it: nanscan.runtime.traps). loss_scale: the
    factor each micro-batch's loss (as step_fn returns it) is multiplied by before its backward, as the loop scaled
    it (1/n for a mean over n micro-batches, 1 for a sum; nanscan.runtime.loop_effects NOTE: [observed loop]);
    None: the mean (NOTE: [replayed accumulation]), or what the run recorded where the rerun is told it.
    """

    lr_scale: float = 1.0
    precision: str | None = None
    clip_grad_norm: float | None = None
    deterministic: bool = False
    eps: float | None = None
    loss_scale: float | None = None

    def __post_init__(self):
        if self.precision is not None and self.precision not in PRECISION_NAMES:
            raise ValueError(f"precision={self.precision!r}: use one of {', '.join(PRECISION_NAMES)} or None")

    def to_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "precision": self.precision, "clip_grad_norm": self.clip_grad_norm,
                "deterministic": self.deterministic, "eps": self.eps, "loss_scale": self.loss_scale}


@dataclass(frozen=True)
class Factor:
    """One change to the rerun step. `drops_samples`: the change is to leave out the suspicious samples (found
    by bisection), which the options cannot express."""

    key: str
    label: str
    options: StepOptions = StepOptions()
    drops_samples: bool = False

    def to_dict(self) -> dict:
        return {"key": self.key, "label": self.label, "options": self.options.to_dict(),
                "drops_samples": self.drops_samples}


BASELINE = Factor("baseline", "as recorded (no change)")
FACTORS: tuple[Factor, ...] = (
    Factor("lr-x0.1", "learning rate x0.1", StepOptions(lr_scale=0.1)),
    Factor("lr-x0.01", "learning rate x0.01", StepOptions(lr_scale=0.01)),
    Factor("fp32", "precision: float32, autocast off", StepOptions(precision="float32")),
    Factor("bf16-autocast", "precision: bfloat16 autocast", StepOptions(precision="bfloat16")),
    Factor("fp16-autocast", "precision: float16 autocast", StepOptions(precision="float16")),
    Factor("clip-1.0", "gradient norm clipped at 1.0", StepOptions(clip_grad_norm=1.0)),
    Factor("drop-suspicious", "suspicious samples dropped", drops_samples=True),
    Factor("deterministic", "deterministic algorithms on", StepOptions(deterministic=True)),
)
FACTOR_KEYS = tuple(f.key for f in FACTORS)
