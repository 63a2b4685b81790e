"""nanscan for a hand-written accelerate loop: `monitor(accelerator, model, optimizer, **options)` gives a Monitor
over the prepared model (unwrapped) and optimizer, with the accelerator's GradScaler, that checks once per
optimizer step with all the step's micro-batches.

    mon = monitor(accelerator, model, optimizer, bundle_dir="bundles")
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            report = mon.check(batch=batch, loss=loss)   # every micro-batch; checks when gradients sync
            if report is not None and not report.ok:     # on_invalid "warn", "skip", "stop" or a callable
                ...
            optimizer.step()
            optimizer.zero_grad()
    mon.close()

Zero-config replay works when the model is a transformers PreTrainedModel called as model(**batch) and the loss
given to check() is the loss it returned; the step's loss is then the micro-batches' mean, as accelerator.backward
divides each by gradient_accumulation_steps.
"""

from __future__ import annotations

from typing import Any

import accelerate
import torch

from nanscan.integrations.rebuild import RECIPE_KEY, optimizer_recipe, pretrained_model, unavailable
from nanscan.integrations.session import StepSession, autocast_region, call_before, check_on_invalid
from nanscan.engine.stats import ScanReport

__all__ = ["AcceleratedMonitor", "monitor"]

MODEL_LOSS = {"kind": "model_loss", "loss_scaled_for_ga": False}


def scaler_of(accelerator: accelerate.Accelerator) -> Any:
    """The accelerator's GradScaler (mixed_precision="fp16"), else None."""
    return getattr(accelerator, "scaler", None)


class AcceleratedMonitor:
    """A nanscan Monitor inside an accelerate loop (see the module docstring); `monitor` is the Monitor itself.

    check() collects micro-batches while accelerator.sync_gradients is False and returns None for them; at the
    step's last micro-batch it checks them all and returns the report. The previous step's update counts as
    skipped in `numbers()` when accelerator.optimizer_step_was_skipped says so (a GradScaler's overflow skip).
    on_invalid="stop" skips the update as "skip" does and sets `stop_requested`: end the loop on it.
    """

    def __init__(self, accelerator: accelerate.Accelerator, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, **options: Any):
        check_on_invalid(options.get("on_invalid", "raise"))
        self.accelerator = accelerator
        # Under accelerate's DeepSpeed plugin, prepare() gave the engine as the model: the session reads its ZeRO
        # partitions (StepSession's engine)
        engine = model if accelerator.distributed_type == accelerate.utils.DistributedType.DEEPSPEED else None
        model = accelerator.unwrap_model(model)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        recipe = {"model": pretrained_model(model), "optimizer": optimizer_recipe(inner, model),
                  "step": dict(MODEL_LOSS)}
        self.session = StepSession(model, inner, recipe=recipe, scaler=scaler_of(accelerator), options=options,
                                   engine=engine)
        # Under DeepSpeed, accelerator.backward() runs engine.step() at the step's last micro-batch, which updates
        # the weights and frees the gradient partitions before check() is called: the step is checked just before
        # it, from the micro-batch and loss the model's hooks saw, and check() returns that report.
        self._engine_report: ScanReport | None = None
        self._undo = call_before(engine, "step", self._before_engine_step) if engine is not None else lambda: None
        self._output_loss: torch.Tensor | None = None
        self._call: dict | None = None
        self._checked = False
        self._hooks = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True),
                       model.register_forward_hook(self._on_output)]

    @property
    def monitor(self):
        return self.session.monitor

    @property
    def stop_requested(self) -> bool:
        return self.session.stop_requested

    def _on_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._call = None if args else kwargs
        if module.training and not self.session.inputs:  # the step's first micro-batch
            # accelerate's autocast is entered inside forward, after every hook: the precision is the accelerator's
            self.session.begin_step(autocast_region(self.accelerator.mixed_precision, self.accelerator.device.type))

    def _on_output(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._output_loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)

    def _model_loss_reason(self, batch: Any, loss: Any) -> str | None:
        """Why this micro-batch's loss is not the model's own loss on model(**batch), or None when it is."""
        if loss is None or loss is not self._output_loss:
            return "the loss given to check() is not the `loss` the model returned"
        call = self._call
        if not isinstance(batch, dict) or call is None or any(call.get(k) is not v for k, v in batch.items()):
            return "the model was not called as model(**batch) with the batch given to check()"
        return None

    def check(self, batch: Any = None, loss: Any = None) -> ScanReport | None:
        """Give one micro-batch and its loss (after accelerator.backward); checks at the step's last one."""
        session = self.session
        if self._checked:  # the previous step's update has run (or was skipped) since its check
            session.after_update(skipped=bool(self.accelerator.optimizer_step_was_skipped))
            self._checked = False
        step_recipe = session.monitor.config[RECIPE_KEY]["step"]
        if "unavailable" not in step_recipe:
            reason = self._model_loss_reason(batch, loss)
            if reason:
                session.monitor.config[RECIPE_KEY]["step"] = unavailable(reason)
        if self._engine_report is not None:  # this micro-batch's step was checked inside engine.step()
            report, self._engine_report = self._engine_report, None
            self._checked = True
            return report
        session.add_micro_batch(batch)
        session.set_loss(loss)
        if not self.accelerator.sync_gradients:
            return None
        self._checked = True
        return session.check(divide_by=len(session.inputs))

    def _before_engine_step(self) -> None:
        """DeepSpeed: check the step that engine.step() is about to apply (its last micro-batch as the model was
        called; a forward called with positional arguments leaves that micro-batch out of the batch)."""
        session = self.session
        session.add_micro_batch(self._call if self._call is not None else {})
        session.set_loss(self._output_loss)
        self._engine_report = session.check(divide_by=len(session.inputs))

    def numbers(self) -> dict[str, int]:
        return self.session.numbers()

    def close(self) -> None:
        self._remove_hooks()
        self.session.close()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._undo()
        self._undo = lambda: None

    def __enter__(self) -> "AcceleratedMonitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        self._remove_hooks()
        self.session.abandon(exc)


def monitor(accelerator: accelerate.Accelerator, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None = None, **options: Any) -> AcceleratedMonitor:
    """A nanscan Monitor for an accelerate loop over the prepared `model` and `optimizer`.

    options: nanscan.Monitor's keyword arguments; on_invalid also "stop" (see AcceleratedMonitor)."""
    return AcceleratedMonitor(accelerator, model, optimizer, **options)
