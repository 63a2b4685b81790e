"""What a replay can be asked to do, without torch: the options a replayed step runs under (StepOptions, the
precisions by name), the ablations' factors (Factor, FACTORS) and the defaults of replay() and
export_regression().

They live apart from the modules that run the step so that `nanscan replay --help`, `nanscan export-regression
--help` and `nanscan ablate --help` show them without importing torch (NOTE: [fast help] in nanscan/cli/main.py);
nanscan.replay.step maps each precision to its torch dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

# The precisions a replayed step can run in: "float32" turns autocast off, the others autocast to that dtype.
PRECISION_NAMES = ("float32", "bfloat16", "float16")

DEFAULT_RUNS = 3  # the reproduction and two more, to tell persistent from transient

DEFAULT_MAX_STATE_MB = 64  # the largest model and optimizer state a regression case stores by default


@dataclass(frozen=True)
class StepOptions:
    """How a replayed step differs from the recorded one (the ablation factors), all off by default.

    lr_scale: multiplies every param group's learning rate. precision: None (as recorded: the run's autocast region
    re-applied around step_fn, NOTE: [replayed precision] in nanscan/replay/step.py), "float32" (weights and batch
    in float32, autocast off), "bfloat16" or "float16" (float32 weights, torch.autocast to that dtype).
    clip_grad_norm: clip the total gradient norm before optimizer.step(). deterministic: torch's deterministic
    algorithms (warn-only where an operation has none) and deterministic cuDNN. eps: the optimizer's eps in every
    param group that has one (Adam's, where an update trap points at it: nanscan.replay.traps).
    """

    lr_scale: float = 1.0
    precision: str | None = None
    clip_grad_norm: float | None = None
    deterministic: bool = False
    eps: float | None = None

    def __post_init__(self):
        if self.precision is not None and self.precision not in PRECISION_NAMES:
            raise ValueError(f"precision={self.precision!r}: use one of {', '.join(PRECISION_NAMES)} or None")

    def to_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "precision": self.precision, "clip_grad_norm": self.clip_grad_norm,
                "deterministic": self.deterministic, "eps": self.eps}


@dataclass(frozen=True)
class Factor:
    """One change to the replayed step. `drops_samples`: the change is to leave out the suspicious samples (found
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
