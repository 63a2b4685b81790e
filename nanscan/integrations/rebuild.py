"""Zero-config replay: the recipe a framework adapter records in the bundle's config (the model's class and config
or hyperparameters, the optimizer's class and param groups, how the step's loss is formed from its micro-batches),
and `replay_entry`, the replay entry that rebuilds the step from it.

A bundle written by an integration names REPLAY_ENTRY as its replay entry and keeps the recipe under
config[RECIPE_KEY], so `nanscan replay`, `ablate` and `export-regression` work on it as on any other bundle. The
step's batch is {"micro_batches": [...]}: every micro-batch of the optimizer step, in order. Nothing here imports a
framework: the classes are imported by the paths recorded, at replay time, and called only when they are of the
kind the recipe says (NOTE: [trust rule] in nanscan/entry.py): a transformers PreTrainedModel and PretrainedConfig,
a LightningModule, a torch.optim.Optimizer, each with the recipe's JSON data as its only arguments.

A part that cannot be rebuilt is recorded as {"unavailable": reason}; replay_entry then raises, naming the reason
and `--entry`. The recipe, in full:

    {"model": {"kind": "pretrained", "class": "pkg.mod:Cls", "config_class": "...", "config": {...}, "dtype": ...}
              | {"kind": "lightning", "class": "pkg.mod:Cls", "hparams": {...}},
     "optimizer": {"class": "torch.optim.adamw:AdamW", "groups": [{"params": [names], "settings": {...}}]},
     "step": {"kind": "model_loss", "loss_scaled_for_ga": null | bool}      (the Trainer's rule, see step_loss)
           | {"kind": "training_step", "divide_by": n}}                     (LightningModule.training_step / n)
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch

from nanscan.entry import EntryError, ReplaySpec, UntrustedError, load_bundle_class
from nanscan.entry import replay_entry as marked_entry
from nanscan.engine.inputs import batch_size, take_rows
from nanscan.bundle.provenance import ConfigError, normalize_config

__all__ = ["MICRO_BATCHES", "RECIPE_KEY", "REPLAY_ENTRY", "RebuildError", "class_path", "lightning_model",
           "micro_batches", "step_function",
           "optimizer_recipe", "pretrained_model", "replay_entry", "select_rows", "step_loss", "unavailable",
           "with_recipe"]

RECIPE_KEY = "nanscan_rebuild"
REPLAY_ENTRY = "nanscan.integrations.rebuild:replay_entry"
MICRO_BATCHES = "micro_batches"
NUM_ITEMS = "num_items_in_batch"  # the Trainer's token count, passed to the model's forward with each micro-batch


class RebuildError(EntryError):
    """The bundle's step cannot be rebuilt from its recipe: the message names the reason and what to pass."""


def unavailable(reason: str) -> dict:
    return {"unavailable": reason}


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_class(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def unimportable(cls: type) -> str | None:
    """Why replay could not import `cls` by its path, or None when it can."""
    if cls.__module__ == "__main__":
        return (f"{cls.__qualname__} is defined in the script being run (__main__), which replay cannot import; "
                "move it into an importable module")
    if "<locals>" in cls.__qualname__:
        return f"{cls.__qualname__} is defined inside a function, so replay cannot import it"
    try:
        found = _load_class(class_path(cls))
    except (ImportError, AttributeError) as exc:
        return f"{class_path(cls)} cannot be imported ({exc})"
    if found is not cls:
        return f"{class_path(cls)} imports as another object than the class trained"
    return None


def _json(value: Any, what: str) -> tuple[Any, str | None]:
    try:
        return normalize_config({"value": value})["value"], None
    except ConfigError as exc:
        return None, f"{what} cannot be stored as JSON ({exc})"


def with_recipe(config: Any, recipe: dict) -> dict:
    """The Monitor's config: the user's (a dict, dataclass or namespace, as the Monitor takes it) with the recipe."""
    return {**(normalize_config(config) or {}), RECIPE_KEY: recipe}


# -- recording ------------------------------------------------------------------------------------------------

def _uniform_dtype(model: torch.nn.Module) -> str | None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None


def pretrained_model(model: torch.nn.Module) -> dict:
    """A transformers PreTrainedModel (anything with a `config` that has `to_dict()`): its class and config."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return unavailable(f"{type(model).__name__} has no config with to_dict(), so it cannot be rebuilt from one")
    reason = unimportable(type(model)) or unimportable(type(config))
    if reason:
        return unavailable(reason)
    values, reason = _json(config.to_dict(), f"the config of {type(model).__name__}")
    if reason:
        return unavailable(reason)
    return {"kind": "pretrained", "class": class_path(type(model)), "config_class": class_path(type(config)),
            "config": values, "dtype": _uniform_dtype(model)}


def lightning_model(module: torch.nn.Module) -> dict:
    """A LightningModule: its class and the hyperparameters save_hyperparameters() kept."""
    cls = type(module)
    reason = unimportable(cls)
    if reason:
        return unavailable(reason)
    hparams = dict(getattr(module, "hparams_initial", None) or {})
    try:
        inspect.signature(cls).bind(**hparams)
    except TypeError as exc:
        saved = f"the saved hyperparameters {sorted(hparams)}" if hparams else "no saved hyperparameters"
        return unavailable(f"{cls.__qualname__}(...) cannot be called with {saved} ({exc}); call "
                           "self.save_hyperparameters() in its __init__")
    values, reason = _json(hparams, f"the saved hyperparameters of {cls.__qualname__}")
    if reason:
        return unavailable(reason)
    return {"kind": "lightning", "class": class_path(cls), "hparams": values, "dtype": _uniform_dtype(module)}


def optimizer_recipe(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module) -> dict:
    """The optimizer's class and param groups: their settings, and their parameters by name in the model."""
    if optimizer is None:
        return unavailable("no optimizer was found to record")
    reason = unimportable(type(optimizer))
    if reason:
        return unavailable(reason)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        outside = sum(1 for p in group["params"] if id(p) not in names)
        if outside:
            return unavailable(f"param group {index} of {type(optimizer).__name__} holds {outside} parameter(s) "
                               "outside the model, which the recipe cannot name")
        settings, reason = _json({k: v for k, v in group.items() if k != "params"},
                                 f"the settings of param group {index}")
        if reason:
            return unavailable(reason)
        groups.append({"params": [names[id(p)] for p in group["params"]], "settings": settings})
    return {"class": class_path(type(optimizer)), "groups": groups}


# -- the step's loss ------------------------------------------------------------------------------------------

def step_loss(losses: Sequence[torch.Tensor], *, divide_by: int) -> torch.Tensor:
    """The loss of a step whose micro-batches gave `losses`, as the trainer backpropagated it: their sum over
    `divide_by` (the trainers' normalisation under gradient accumulation; 1 when the model's loss is already
    normalised over the whole step)."""
    total = torch.stack([loss.detach().float().reshape(()) for loss in losses]).sum()
    return total / divide_by if divide_by != 1 else total


def trainer_divisor(micro_batches: Sequence[Mapping], loss_scaled_for_ga: bool | None) -> int:
    """The Trainer's rule (transformers.Trainer.training_step): a micro-batch's loss is divided by the number of
    micro-batches unless it is already scaled for accumulation, which by default means the model was given the
    step's token count (num_items_in_batch) and normalised its loss by it."""
    scaled = loss_scaled_for_ga
    if scaled is None:
        scaled = all(NUM_ITEMS in batch for batch in micro_batches)
    return 1 if scaled else len(micro_batches)


# -- rebuilding -----------------------------------------------------------------------------------------------

# -- what a recipe may call (NOTE: [trust rule] in nanscan/entry.py) -------------------------------------------

def _subclass_of(cls: type, bases: Sequence[tuple[str, str]]) -> bool:
    """Whether `cls` derives from one of `bases` ((module, name) pairs). A framework that importing the class did
    not import cannot be one of its bases, so nothing is imported here."""
    for module_name, name in bases:
        base = getattr(sys.modules.get(module_name), name, None)
        if isinstance(base, type) and issubclass(cls, base):
            return True
    return False


_PRETRAINED_MODEL = (("transformers", "PreTrainedModel"),)
_PRETRAINED_CONFIG = (("transformers", "PretrainedConfig"),)
_LIGHTNING_MODULE = (("lightning.pytorch", "LightningModule"), ("pytorch_lightning", "LightningModule"))


def _recipe_class(recipe: Mapping, key: str, bases: Sequence[tuple[str, str]], kind: str) -> type:
    return load_bundle_class(recipe.get(key), field=f"config.{RECIPE_KEY}.model.{key}",
                             kind=kind, accept=lambda cls: _subclass_of(cls, bases))


def _recipe_dtype(recipe: Mapping) -> torch.dtype | None:
    name = recipe.get("dtype")
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise UntrustedError(f"the bundle's config.{RECIPE_KEY}.model.dtype is {name!r}, not a torch dtype; the "
                             "bundle was edited or damaged: pass --entry package.module:function")
    return dtype


def _build_model(recipe: dict) -> torch.nn.Module:
    kind = recipe.get("kind")
    if kind == "pretrained":
        cls = _recipe_class(recipe, "class", _PRETRAINED_MODEL, "transformers PreTrainedModel")
        config_cls = _recipe_class(recipe, "config_class", _PRETRAINED_CONFIG, "transformers PretrainedConfig")
        model = cls(config_cls.from_dict(dict(recipe["config"])))
    elif kind == "lightning":
        cls = _recipe_class(recipe, "class", _LIGHTNING_MODULE, "LightningModule")
        if not isinstance(recipe.get("hparams"), Mapping):
            raise RebuildError(f"the bundle's config.{RECIPE_KEY}.model.hparams is not an object of keyword "
                               "arguments: pass --entry")
        model = cls(**recipe["hparams"])
    else:
        raise RebuildError(f"the bundle's config.{RECIPE_KEY}.model.kind is {kind!r}, not 'pretrained' or "
                           "'lightning': pass --entry")
    dtype = _recipe_dtype(recipe)
    return model.to(dtype) if dtype is not None else model


def _optimizer_factory(recipe: dict) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    cls = load_bundle_class(recipe.get("class"), field=f"config.{RECIPE_KEY}.optimizer.class",
                            kind="torch.optim.Optimizer", accept=lambda c: issubclass(c, torch.optim.Optimizer))

    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        params = dict(model.named_parameters())
        missing = [n for g in recipe["groups"] for n in g["params"] if n not in params]
        if missing:
            raise RebuildError(f"the rebuilt model has no parameter {missing[0]!r} that the optimizer's recipe names")
        groups = [{**{k: tuple(v) if isinstance(v, list) else v for k, v in g["settings"].items()},
                   "params": [params[n] for n in g["params"]]} for g in recipe["groups"]]
        return cls(groups)

    return build


def micro_batches(batch: Any) -> list:
    if not isinstance(batch, Mapping) or not isinstance(batch.get(MICRO_BATCHES), list):
        raise RebuildError(f"the batch is not the {{'{MICRO_BATCHES}': [...]}} an integration records; this bundle "
                           "was not written by nanscan.integrations: pass --entry")
    return batch[MICRO_BATCHES]


def _label_count(micro: Sequence[Mapping], shifted: bool) -> int:
    """The Trainer's num_items_in_batch rule: labels other than -100, without each row's first when shifted."""
    return int(sum(int((b["labels"][..., 1:] if shifted else b["labels"]).ne(-100).sum()) for b in micro))


def _recount(micro: list, kept: list) -> list:
    """`kept` micro-batches with num_items_in_batch counted again over them, by the rule (labels shifted for a
    causal LM, or not) that gives the value recorded for the whole step; unchanged when neither does."""
    recorded = [b.get(NUM_ITEMS) for b in micro if isinstance(b, Mapping) and NUM_ITEMS in b]
    if not recorded or not all(isinstance(b, Mapping) and "labels" in b for b in micro):
        return kept
    value = recorded[0]
    value = int(value) if not isinstance(value, torch.Tensor) else int(value.reshape(-1)[0])
    for shifted in (True, False):
        if _label_count(micro, shifted) == value:
            count = _label_count(kept, shifted)
            like = recorded[0]
            new = torch.tensor(count, dtype=like.dtype, device=like.device) if isinstance(like, torch.Tensor) \
                else count
            return [{**b, NUM_ITEMS: new} if NUM_ITEMS in b else b for b in kept]
    return kept


def select_rows(batch: Any, rows: Sequence[int]) -> dict:
    """ReplaySpec.select_samples of an integration's step: `rows` number the samples across its micro-batches in
    order (as nanscan.integrations.session records their ids). Each micro-batch keeps its selected rows, one left
    without any is dropped (with its Lightning batch index), and a recorded num_items_in_batch is counted again
    over what is kept, as the Trainer would have for those samples."""
    micro = micro_batches(batch)
    wanted, kept, where, offset = sorted(set(int(r) for r in rows)), [], [], 0
    for index, inputs in enumerate(micro):
        size = batch_size(inputs)
        if size is None:
            raise RebuildError(f"micro-batch {index} has no tensor with a sample dimension, so its samples cannot be "
                               "selected: pass --entry with a ReplaySpec.select_samples")
        local = [r - offset for r in wanted if offset <= r < offset + size]
        offset += size
        if local:
            kept.append(take_rows(inputs, local, size))
            where.append(index)
    outside = [r for r in wanted if not 0 <= r < offset]
    if outside:
        raise RebuildError(f"rows {outside} are outside the step's {offset} samples")
    out = {**batch, MICRO_BATCHES: _recount(micro, kept)}
    if isinstance(batch.get("batch_indices"), list):
        out["batch_indices"] = [batch["batch_indices"][i] for i in where]
    return out


def _model_loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise RebuildError("the model returned no loss for a recorded micro-batch (were its labels recorded?)")
    return loss


def step_function(recipe: dict) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """The step's loss as the recipe's trainer forms it, over the recorded micro-batches: the replay entry's step_fn,
    and the integrations' default Monitor(step_fn=...) where the recipe says the loss is the model's own."""
    kind = recipe["kind"]
    if kind == "model_loss":
        scaled = recipe.get("loss_scaled_for_ga")

        def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            micro = micro_batches(batch)
            divisor = trainer_divisor(micro, scaled)
            return sum(_model_loss(model(**inputs)) for inputs in micro) / divisor

        return step

    divide_by = int(recipe.get("divide_by") or 1)

    def training_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        micro = micro_batches(batch)
        indices = batch.get("batch_indices") or list(range(len(micro)))
        total = 0
        with warnings.catch_warnings():
            # self.log() with no Trainer attached only warns that nothing is logged: nothing is, on replay
            warnings.filterwarnings("ignore", message=".*self.log.*")
            for inputs, index in zip(micro, indices):
                out = model.training_step(inputs, index)
                total = total + (out["loss"] if isinstance(out, Mapping) else out)
        return total / divide_by

    return training_step


@marked_entry
def replay_entry(config: dict) -> ReplaySpec:
    """The replay entry of bundles written by nanscan.integrations: the step rebuilt from config[RECIPE_KEY]."""
    recipe = (config or {}).get(RECIPE_KEY)
    if not isinstance(recipe, Mapping):
        raise RebuildError(f"the bundle's config holds no '{RECIPE_KEY}' recipe, so the step cannot be rebuilt "
                           "without a replay entry: pass --entry package.module:function (a function taking the "
                           "config dict and returning a nanscan.entry.ReplaySpec)")
    parts = {part: recipe.get(part) or unavailable("not recorded") for part in ("model", "optimizer", "step")}
    reasons = [f"{part}: {entry['unavailable']}" for part, entry in parts.items() if "unavailable" in entry]
    if reasons:
        raise RebuildError("this bundle's step cannot be rebuilt without a replay entry (" + "; ".join(reasons)
                           + "): pass --entry package.module:function (a function taking the config dict and "
                           "returning a nanscan.entry.ReplaySpec)")
    optimizer = _optimizer_factory(recipe["optimizer"])  # every class checked before any is called
    return ReplaySpec(_build_model(recipe["model"]), optimizer, step_function(recipe["step"]),
                      select_samples=select_rows)
