"""nanscan for Lightning: NanscanCallback checks every optimizer step (all its micro-batches, their losses, the
weights, gradients and optimizer state) before the update, and records what rebuilds the step.

    from nanscan.integrations.lightning import NanscanCallback
    trainer = lightning.Trainer(max_epochs=3, callbacks=[NanscanCallback(bundle_dir="bundles")])
    trainer.fit(module, loader)    # a NaN step raises nanscan.NonFiniteError, its evidence bundle written

The step starts at the first micro-batch's on_train_batch_start (RNG states, snapshot="cpu", the precision plugin's
autocast), the batch comes from on_train_batch_start (each micro-batch under accumulate_grad_batches), its loss from
on_before_backward (already divided by accumulate_grad_batches, as Lightning backpropagates it), and the check runs
in on_before_optimizer_step, after Lightning's own unscale under 16-mixed (not unscaled again), with step =
trainer.global_step. on_invalid="stop" skips the bad update and sets trainer.should_stop. The same class serves
pytorch_lightning (its Trainer calls callbacks by hook name); it subclasses lightning.pytorch's Callback when
lightning is installed, else pytorch_lightning's.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name, the same hooks
    import pytorch_lightning as pl

from nanscan.integrations.rebuild import lightning_model, optimizer_recipe, unavailable
from nanscan.integrations.session import StepSession, autocast_region, check_on_invalid, with_step_fn

__all__ = ["NanscanCallback"]


def scaler_of(trainer: Any) -> Any:
    """The GradScaler of the Trainer's precision plugin (16-mixed), else None."""
    plugin = getattr(trainer, "precision_plugin", None) or getattr(trainer.strategy, "precision_plugin", None)
    return getattr(plugin, "scaler", None)


def step_recipe(trainer: Any, module: Any) -> dict:
    if not module.automatic_optimization:
        return unavailable(f"{type(module).__qualname__} uses manual optimization, so training_step runs the "
                           "optimizer itself")
    return {"kind": "training_step", "divide_by": int(trainer.accumulate_grad_batches)}


class NanscanCallback(pl.Callback):
    """A Lightning Callback that runs a nanscan Monitor over the LightningModule and its (first) optimizer.

    monitor_options: nanscan.Monitor's keyword arguments (bundle_dir, run_id, config, snapshot, mode, ...);
    on_invalid is "raise" (default: NonFiniteError leaves trainer.fit()), "warn", "skip", "stop", a callable, or a
    nanscan.Rollback(...) (back to the window's kept state, the bad step's update dropped, training goes on);
    sample_id_field: the key of a (dict) batch that holds each sample's id, recorded for bisection.
    nanscan's numbers (nanscan.integrations.session.LOG_KEYS) are logged with pl_module.log at every step.
    """

    def __init__(self, **monitor_options: Any):
        check_on_invalid(monitor_options.get("on_invalid", "raise"))
        self.options = monitor_options
        self.session: StepSession | None = None
        self._batch_indices: list[int] = []

    @property
    def monitor(self):
        return None if self.session is None else self.session.monitor

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        recipe = {"model": lightning_model(pl_module), "optimizer": optimizer_recipe(optimizer, pl_module),
                  "step": step_recipe(trainer, pl_module)}
        self.session = StepSession(pl_module, optimizer, recipe=recipe, scaler=scaler_of(trainer),
                                   options=with_step_fn(self.options, recipe["step"]))
        self._batch_indices = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self._batch_indices:  # the optimizer step's first micro-batch: its start, whatever training_step calls
            self.session.begin_step(autocast_region(trainer.precision, trainer.strategy.root_device.type))
        self.session.add_micro_batch(batch)
        self._batch_indices.append(int(batch_idx))

    def on_before_backward(self, trainer, pl_module, loss):
        self.session.set_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        indices, self._batch_indices = self._batch_indices, []
        session = self.session
        session.check(step=trainer.global_step, extra={"batch_indices": indices})
        if session.stop_requested:
            trainer.should_stop = True
        for key, value in session.numbers().items():
            pl_module.log(key, float(value), on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module):
        if self.session is not None:
            self.session.close()

    def on_exception(self, trainer, pl_module, exception):
        if self.session is not None:
            self.session.abandon(exception)
