"""What a replay can be asked to do, without torch: the ablations' factors (Factor, FACTORS) over the options a
rerun step runs under (StepOptions and the precisions by name, from nanscan.runtime.step_options), and the
defaults of replay() and export_regression().

They live apart from the modules that run the step so that `nanscan replay --help`, `nanscan export-regression
--help` and `nanscan ablate --help` show them without importing torch (NOTE: [fast help] in nanscan/cli/main.py);
nanscan.runtime.rerun maps each precision to its torch dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanscan.runtime.step_options import PRECISION_NAMES, StepOptions  # noqa: F401 - re-exported: the tools' names

DEFAULT_RUNS = 3  # the reproduction and two more, to tell persistent from transient

DEFAULT_MAX_STATE_MB = 64  # the largest model and optimizer state a regression case stores by default


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
