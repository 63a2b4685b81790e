"""nanscan for transformers.Trainer: NanscanCallback checks every optimizer step (all its micro-batches, their
losses, the weights, gradients and optimizer state) before the update, and records what rebuilds the step.

    from nanscan.integrations.transformers import NanscanCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[NanscanCallback(bundle_dir="bundles")])
    trainer.train()          # a NaN step raises nanscan.NonFiniteError, its evidence bundle written

The Trainer's hooks do not carry the batch or the loss, so the callback watches the model itself: a forward
pre-hook keeps each micro-batch as the model receives it (model(**inputs), num_items_in_batch included) and a
forward hook its `loss`. The check runs just before the Trainer's gradient clipping (accelerator.clip_grad_norm_,
which the Trainer calls every step, with an infinite norm when max_grad_norm=0): a clip over one NaN gradient makes
them all NaN, and the first bad tensor would be lost. Where no clip is called, it runs in on_pre_optimizer_step.
Its step is state.global_step + 1: the number the Trainer gives this update in its logs (and checkpoint-N).
on_invalid="stop" skips the bad update and sets control.should_training_stop. nanscan's numbers are added to the
Trainer's logs (nanscan.integrations.session.LOG_KEYS), where logging_nan_inf_filter cannot smooth them away.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback

from nanscan.integrations.rebuild import (NUM_ITEMS, micro_batches, optimizer_recipe, pretrained_model, trainer_divisor,
                                         unavailable)
from nanscan.integrations.session import StepSession, autocast_region, call_before, check_on_invalid, with_step_fn

__all__ = ["NanscanCallback"]


def calling_trainer() -> Trainer | None:
    """The Trainer whose loop is calling the current hook. Callbacks are not given it, yet its compute_loss,
    compute_loss_func and label smoothing decide whether the model's own loss is the step's loss, and its optimizer
    is the one train() created (a callback's `optimizer` argument is the one given to Trainer(), usually None)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def step_recipe(trainer: Trainer | None) -> dict:
    """How the Trainer forms the step's loss, when it is the model's own loss (else why it is not)."""
    if trainer is None:
        return unavailable("the Trainer could not be found from its callback, so how it forms the loss is unknown")
    kind = type(trainer)
    for method in ("compute_loss", "training_step"):
        if getattr(kind, method) is not getattr(Trainer, method):
            return unavailable(f"{kind.__qualname__} overrides {method}, so the step's loss is not the model's own")
    if trainer.compute_loss_func is not None:
        return unavailable("the Trainer was given compute_loss_func, so the step's loss is not the model's own")
    if trainer.label_smoother is not None:
        return unavailable(f"the Trainer applies label smoothing (label_smoothing_factor="
                           f"{trainer.args.label_smoothing_factor}) to the model's outputs")
    return {"kind": "model_loss", "loss_scaled_for_ga": getattr(trainer, "loss_is_scaled_for_ga", None)}


def trainer_loss_fn(trainer: Trainer) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """The callback's default Monitor(step_fn=...) where the Trainer forms the loss itself (a compute_loss override,
    as TRL's SFTTrainer's; compute_loss_func; label smoothing): through trainer.compute_loss over the recorded
    micro-batches ({"micro_batches": [...]}, each as the model received it), each given the tensors the collator
    made and the step's token count as the Trainer passes them, then divided as Trainer.training_step divides
    (nanscan.integrations.session.with_step_fn)."""

    def trainer_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        micro = micro_batches(batch)
        total = 0
        for inputs in micro:
            # the model's forward also got the token count (and may get flags): compute_loss takes it apart
            tensors = {key: value for key, value in inputs.items()
                       if key != NUM_ITEMS and isinstance(value, torch.Tensor)}
            count = inputs.get(NUM_ITEMS)
            loss = trainer.compute_loss(model, tensors, num_items_in_batch=count)
            # Trainer.training_step's rule: the loss is scaled for accumulation where it was normalized by the
            # token count (the model or compute_loss_func did), else divided by the micro-batch count
            scaled = trainer.loss_is_scaled_for_ga if getattr(trainer, "loss_is_scaled_for_ga", None) is not None \
                else (getattr(trainer, "model_accepts_loss_kwargs", False) and count is not None) or \
                trainer.compute_loss_func is not None
            total = total + (loss if scaled else loss / len(micro))
        return total

    return trainer_loss


def model_recipe(model: torch.nn.Module) -> dict:
    if not isinstance(model, PreTrainedModel):
        return unavailable(f"{type(model).__qualname__} is not a transformers PreTrainedModel, so it cannot be "
                           "rebuilt from a config")
    return pretrained_model(model)


def scaler_of(optimizer: Any) -> Any:
    """The GradScaler of the Trainer's (accelerate-prepared) optimizer under fp16, else None."""
    return getattr(optimizer, "scaler", None)


class NanscanCallback(TrainerCallback):
    """A TrainerCallback that runs a nanscan Monitor over the Trainer's model and optimizer.

    monitor_options: nanscan.Monitor's keyword arguments (bundle_dir, run_id, config, snapshot, mode, ...);
    on_invalid is "raise" (default: NonFiniteError leaves trainer.train()), "warn", "skip", "stop", a callable, or
    a nanscan.Rollback(...) (back to the window's kept state, the bad step's update dropped, training goes on;
    nanscan.skip_quarantined(train_dataset, bundle_dir) keeps the records it quarantined out of the next run);
    sample_id_field: a column of the batch that holds each sample's id (a dataset index, a record id), recorded
    for bisection and taken out of the model's inputs (TrainingArguments(remove_unused_columns=False) keeps it).
    micro_batches: under gradient accumulation, also check each micro-batch but the last after its backward
    (on_substep_end; under DDP inside no_sync()), so that the micro-batch and the rank that went bad first are
    named (nanscan.runtime.verdict NOTE: [micro-batch checks]); with on_invalid "raise" or "warn". Not under
    DeepSpeed, whose partitions are filled at the step's last micro-batch only.
    `monitor` and `session` are the current train() call's, from on_train_begin on.
    """

    def __init__(self, *, micro_batches: bool = False, **monitor_options: Any):
        policy = monitor_options.get("on_invalid", "raise")
        check_on_invalid(policy)
        if micro_batches and policy in ("skip", "stop"):
            raise ValueError(f"micro_batches=True with on_invalid={policy!r}: a micro-batch's check cannot skip the "
                             "rest of its step's accumulation; use 'raise' or 'warn'")
        self.options = monitor_options
        self.micro_batches = micro_batches
        self.session: StepSession | None = None
        self._optimizer: Any = None
        self._scaled_for_ga: bool | None = None
        self._forward_params: list[str] = []
        self._hooks: list = []
        self._unwrap: Any = lambda: None  # undoes _wrap_clipping
        self._state: Any = None  # the TrainerState of the step being collected
        self._collecting = False
        self._under_deepspeed = False

    @property
    def monitor(self):
        return None if self.session is None else self.session.monitor

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = calling_trainer()
        engine = None
        if trainer is not None:
            model, optimizer = trainer.model, trainer.optimizer
            if getattr(trainer, "is_deepspeed_enabled", False):  # the Trainer's DeepSpeed plugin: the engine
                engine = trainer.model_wrapped
            callbacks = trainer.callback_handler.callbacks
            if self in callbacks:  # first, so that the reporters' on_log (TensorBoard, W&B, ...) see its numbers
                callbacks.insert(0, callbacks.pop(callbacks.index(self)))
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        step = step_recipe(trainer)
        recipe = {"model": model_recipe(model), "optimizer": optimizer_recipe(inner, model), "step": step}
        self._remove_hooks()
        options = with_step_fn(self.options, step, engine=engine,
                               fallback=lambda: trainer_loss_fn(trainer) if trainer is not None else None)
        self.session = StepSession(model, inner, recipe=recipe, scaler=scaler_of(optimizer), options=options,
                                   engine=engine)
        self._under_deepspeed = engine is not None
        self._optimizer = optimizer
        self._scaled_for_ga = step.get("loss_scaled_for_ga")
        self._forward_params = [name for name, p in inspect.signature(model.forward).parameters.items()
                                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._hooks = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True),
                       model.register_forward_hook(self._on_output)]
        # Checked before the Trainer clips its gradients (see the module docstring), or under DeepSpeed before the
        # engine's step(), which accelerate runs inside accelerator.backward(): by on_pre_optimizer_step the
        # update is done and the gradient partitions are freed. Undone by _remove_hooks.
        accelerator = getattr(trainer, "accelerator", None)
        owner, name = (engine, "step") if engine is not None else (accelerator, "clip_grad_norm_")
        if getattr(owner, name, None) is not None:
            self._unwrap = call_before(owner, name, self._check_if_collecting)

    def _check_if_collecting(self) -> None:
        if self._collecting:
            self._check_step()

    def on_step_begin(self, args, state, control, **kwargs):
        self._collecting = True
        self._state = state
        # accelerate enters autocast inside the model's forward, where no hook sees it: the precision is args'
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
        self.session.begin_step(autocast_region(precision, args.device.type))

    def _on_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._collecting and module.training:
            field = self.session.sample_id_field
            if field is not None and field in kwargs:
                # taken out before the model sees it (its forward has no such argument); the Trainer keeps the
                # column only with remove_unused_columns=False
                kwargs = dict(kwargs)
                ids = kwargs.pop(field)
                self.session.add_micro_batch({**dict(zip(self._forward_params, args)), **kwargs}, ids=ids)
                return args, kwargs
            self.session.add_micro_batch({**dict(zip(self._forward_params, args)), **kwargs})
        return None

    def _on_output(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._collecting and module.training:
            self.session.set_loss(output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None))

    def on_substep_end(self, args, state, control, **kwargs):
        """micro_batches=True: a micro-batch that is not its step's last was just backpropagated (under DDP inside
        no_sync()): check it on its own (StepSession.check_micro_batch)."""
        if self.micro_batches and self._collecting and not self._under_deepspeed:
            self._checked(lambda: self.session.check_micro_batch(step=self._state.global_step + 1))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._collecting:  # no clip was called this step
            self._check_step()
        if self.session.stop_requested:
            control.should_training_stop = True
        return control

    def _check_step(self) -> None:
        self._collecting = False
        session = self.session
        self._checked(lambda: session.check(step=self._state.global_step + 1,
                                            divide_by=trainer_divisor(session.inputs, self._scaled_for_ga)))

    def _checked(self, check: Any) -> None:
        """Run one of the session's checks; if it raises, train() ends here: the model and the accelerator are
        left as they were given and the session is closed as the loop's exception leaves."""
        try:
            check()
        except BaseException as exc:
            self._remove_hooks()
            self.session.abandon(exc)
            raise

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.session.after_update(skipped=bool(getattr(self._optimizer, "step_was_skipped", False)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.session is None:
            return
        numbers = self.session.numbers()
        logs.update(numbers)  # what the reporting callbacks (run after this one, see on_train_begin) receive
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(numbers)  # the Trainer appended its copy before calling on_log

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hooks()
        if self.session is not None:
            self.session.close()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._unwrap()
        self._unwrap = lambda: None
        self._collecting = False
