"""W&B export of nanscan's statistics, live from a Monitor (`Monitor(..., wandb=run, log_every=N)` with a run from
`wandb.init()`): the same scalars, per-module gradient norms and exponent histograms as the TensorBoard export, from
the same core (nanscan.integrations.live), logged into the user's run.

The one module that imports wandb, and only when a run is handed to it: importing it costs nothing.

What is logged (keys; W&B's workspace groups keys by their first part, so all of nanscan's sit together):
  nanscan/step                              the training step: the x axis of every nanscan/ key (NOTE: [wandb step])
  nanscan/loss, nanscan/lr, nanscan/grad_norm, nanscan/nonfinite_tensors, nanscan/nonfinite_elements
                                            every step (0 non-finite on a healthy step; grad_norm NaN or inf at a
                                            step whose gradients hold a NaN or an infinity: NOTE: [non-finite
                                            norms])
  nanscan/grad_norm/<module>                every log_every steps and at every non-finite step
  nanscan/exp_hist/<module>/<tensor name>   the same steps: wandb.Histogram(np_histogram=(counts, bin_edges)) over
                                            the occupied bins of log2|x|, integer edges e, e + 1 (NOTE: [exponent
                                            buckets]); none for a tensor without a finite non-zero value, which
                                            W&B's histogram cannot hold empty
  nanscan/nan/<module>/<tensor name>, nanscan/posinf/..., nanscan/neginf/...
                                            at a non-finite step, for every tensor holding a NaN or infinity (so an
                                            all-NaN tensor has its entry)
<module> is a tensor's group (nanscan.integrations.live.group_of).

NOTE: [wandb step]
Each nanscan step is one row of the run's history: one run.log() call that commits its row, holding nanscan/step,
and run.define_metric("nanscan/*", step_metric="nanscan/step") makes that the x axis of every nanscan key, W&B's own
_step then only counting rows. W&B's docs give define_metric for exactly this, logging on an axis of one's own
while other code logs too; wandb's own TensorBoard sync does the same. The alternatives fight the user's logging:
run.log(..., step=s) must never go back, so once the user's own run.log() calls have advanced _step past the
training step W&B drops nanscan's rows (and nanscan's would make the user's step= values fall behind, and be
dropped, the same way); commit=False merges into the row the user commits next, so the steps handed off together
(up to MAX_BUFFERED_STEPS) would overwrite one another. What works beside it: the user's own run.log(d) calls, with
or without commit=False (a row of theirs still open when nanscan commits is committed with nanscan's values in it,
nothing lost), and their own define_metric axes. What does not: a loop that passes step= itself, since nanscan's
rows advance _step too; log the step as a metric instead (run.define_metric("train/*",
step_metric="train/step")), as W&B recommends.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from nanscan.integrations.live import DEFAULT_LOG_EVERY, DEFAULT_MAX_TENSORS, NONFINITE_STATS, LiveExport, StepRow

log = logging.getLogger("nanscan")

PREFIX = "nanscan/"
STEP_KEY = PREFIX + "step"


def _check_run(run: Any) -> None:
    if not (callable(getattr(run, "log", None)) and callable(getattr(run, "define_metric", None))):
        raise TypeError(f"wandb={run!r}: pass a wandb run, `run = wandb.init(...)` (or wandb.run)")


class WandbSink:
    """The live export's W&B sink: logs each step into `run` (NOTE: [wandb step]); the run stays the user's, never
    finished here."""

    def __init__(self, run: Any):
        _check_run(run)
        try:
            import wandb  # noqa: PLC0415 - only when a run is handed in
        except ImportError as exc:
            raise ImportError(f"W&B export needs the wandb package ({exc}); install it with `pip install wandb` or "
                              "`pip install nanscan[wandb]`") from None
        self.run = run
        self._histogram = wandb.Histogram
        self._finished_error = wandb.errors.UsageError
        self._lost = 0  # steps not logged because the run was finished first
        run.define_metric(STEP_KEY)
        run.define_metric(PREFIX + "*", step_metric=STEP_KEY)

    def write(self, rows: Sequence[StepRow]) -> None:
        for i, row in enumerate(rows):
            data: dict[str, Any] = {STEP_KEY: row.step}
            data.update((PREFIX + name, value) for name, value in row.scalars.items() if value is not None)
            for module, norm in (row.module_norms or {}).items():
                data[f"{PREFIX}grad_norm/{module}"] = norm
            for h in row.histograms:
                if h.counts:
                    data[f"{PREFIX}exp_hist/{h.group}/{h.name}"] = self._histogram(np_histogram=(h.counts, h.edges()))
            for c in row.nonfinite:
                data.update((f"{PREFIX}{stat}/{c.group}/{c.name}", getattr(c, stat)) for stat in NONFINITE_STATS)
            try:
                self.run.log(data)
            except self._finished_error:  # the user finished the run before the Monitor closed
                self._lost += len(rows) - i
                return

    def flush(self) -> None:
        """Nothing to do: run.log() has handed each row to wandb's service, which writes it and, at exit, finishes
        the run."""

    def close(self) -> None:
        if self._lost:
            log.warning("nanscan: %d steps were not logged to W&B: the run was finished before the Monitor was "
                        "closed (close the Monitor, or leave its `with` block, before run.finish())", self._lost)
            self._lost = 0


class WandbExport(LiveExport):
    """A live export to W&B with a choice of tensors: Monitor(wandb=WandbExport(run, log_every=N,
    tensors=("grad:*",), max_tensors=M)); see nanscan.integrations.live.LiveExport."""

    def __init__(self, run: Any, *, log_every: int = DEFAULT_LOG_EVERY, tensors: Sequence[str] | None = None,
                 max_tensors: int = DEFAULT_MAX_TENSORS):
        super().__init__([WandbSink(run)], log_every=log_every, tensors=tensors, max_tensors=max_tensors)


def as_sink(run: Any) -> WandbSink | LiveExport:
    """What Monitor(wandb=run) logs through: a WandbExport as given, else a WandbSink."""
    return run if isinstance(run, LiveExport) else WandbSink(run)
