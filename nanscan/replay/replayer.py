"""A bundle opened for replay: its model, optimizer, batch, state and RNG rebuilt through the replay entry, and one
step run again under chosen options."""

from __future__ import annotations

import copy
import os
import random
from typing import Any, Sequence

import numpy as np
import torch

from nanscan.bundle import Bundle, load_bundle
from nanscan.bundle.format import RERUN_FINDING
from nanscan.bundle.frozen import compare, shown
from nanscan.bundle.rank_set import require_full_state
from nanscan.entry import EntryError, ReplaySpec, build_spec, bundle_imports, entry_search_dirs, locate_entry
from nanscan.integrations.rebuild import MICRO_BATCHES
from nanscan.bundle.provenance import restore_rng
from nanscan.replay.step import (HALF_DTYPES, PRECISIONS, ReplayError, StepOptions, StepOutcome, batch_size,
                                 loop_options, model_device, prepare_batch, recorded_precision, run_localized,
                                 run_step, select_samples)


def open_bundle(bundle: Bundle | str | os.PathLike) -> Bundle:
    return bundle if isinstance(bundle, Bundle) else load_bundle(bundle)


def _in_process_rerun(bundle: Bundle) -> str:
    """What the Monitor's in-process rerun of the step did, for the error that asks for a replay entry: its finding
    where it ran, why not where it did not, nothing where the Monitor had no step_fn."""
    step_fn = (bundle.manifest.get("rerun") or {}).get("step_fn")
    if not step_fn:
        return ""
    found = next((f for f in bundle.findings() if f.get("key") == RERUN_FINDING), None)
    record = found.get("record") if found is not None and isinstance(found.get("record"), dict) else {}
    verdict = record.get("verdict")
    if verdict in ("reproduced", "not reproduced"):
        return (f"; the Monitor reran the step in its process through {step_fn}: {verdict} (its finding \"rerun\" "
                "in INCIDENT.md names what it found)")
    why = record.get("reason") if verdict == "not run" else "it recorded no result"
    return f"; the Monitor's in-process rerun through {step_fn} did not run ({why})"


class Replayer:
    """Runs a bundle's failing step again, as often as needed, each time from the bundle's state and RNG states.

    The replay entry is called for every run, so each run starts from a freshly built model and optimizer with
    nothing carried over from an earlier run (a precision change, a hook, optimizer state).
    """

    def __init__(self, bundle: Bundle | str | os.PathLike, entry: str | None = None, *,
                 trust_bundle_paths: bool = False):
        """`entry`: the user's choice of replay entry (else the bundle's, which must be marked); trust_bundle_paths:
        also import from the directories the bundle records (NOTE: [trust rule] in nanscan/entry.py)."""
        self.bundle = open_bundle(bundle)
        self.entry = entry or self.bundle.replay_entry
        self.entry_from_bundle = not entry
        where = self.bundle.path
        if not self.entry:
            done = _in_process_rerun(self.bundle)
            raise ReplayError(f"{where} records no replay entry: pass one with --entry package.module:function "
                              "(a function taking the config dict and returning a nanscan.entry.ReplaySpec), or "
                              f"give replay_entry= to the Monitor{done}")
        # As the training run could: a module beside it (`python -m pkg.train`) need not be installed.
        self.search = entry_search_dirs(self.bundle.manifest["environment"], trust_bundle_paths=trust_bundle_paths)
        found_in = locate_entry(self.entry, self.search)
        self.batch = self.bundle.batch(nested=True)
        if self.batch is None:
            raise ReplayError(f"{where} holds no batch (check() was called without batch=), so the step cannot be "
                              "replayed; pass the batch to Monitor.check")
        info = self.bundle.manifest["state"]
        self.notes: list[str] = []
        if found_in is not None:
            self.notes.append(f"entry: {self.entry!r} is not importable as is; imported it from {found_in} (set "
                              "PYTHONPATH or install the package where regression tests and CI run it)")
        if info.get("file"):
            if self.bundle.manifest.get("distributed"):
                require_full_state(self.bundle)  # one rank's FSDP shards alone do not fit the model
            self.model_state, self.optimizer_state = self.bundle.state()
            _refuse_zero_partitions(self.bundle, self.optimizer_state)
            self.pre_step = bool(info.get("pre_step"))
            if not self.pre_step:
                self.notes.append("state: the bundle holds the state at the failing step's check (no pre-step "
                                  f"snapshot): {info.get('note') or 'buffers may already include this batch'}")
        else:
            self.model_state, self.optimizer_state, self.pre_step = None, None, False
            self.notes.append("state: the bundle holds no model state; the step runs on the freshly built model "
                              "from the replay entry, which may not be the weights that failed")
        # NOTE: [frozen references]: taken from the first model the entry builds, once they check out
        self.frozen = self.bundle.frozen_references() if self.model_state is not None else {}
        if info.get("file") and self.optimizer_state is None:
            self.notes.append("optimizer: the bundle holds no optimizer state; the step uses a fresh optimizer")
        # the autocast region of the step's forward, re-applied around step_fn (NOTE: [replayed precision])
        self.autocast = (self.bundle.manifest.get("mixed_precision") or {}).get("autocast")
        self._precision_said = False
        self.rng = self.bundle.rng_state()
        rng_at = self.bundle.manifest["rng"].get("captured_at")
        if self.rng is None:
            self.notes.append("rng: no RNG state recorded; every replay seeds the generators with 0, so random draws "
                              "(dropout) are the same on each replay but differ from the original step")
        elif rng_at != "step_start":
            self.notes.append(f"rng: recorded at {rng_at or 'an unknown time'}, not at the start of the step; random "
                              "draws in the forward pass (dropout) may differ from the original step")
        # What the replay cannot rebuild exactly: a failure that does not come back may depend on it.
        self.inexact = [text for text in (
            "no model state" if self.model_state is None else "",
            "the state at the check, not a pre-step snapshot" if self.model_state is not None and not self.pre_step
            else "",
            "no optimizer state" if self.model_state is not None and self.optimizer_state is None else "",
            "no RNG state" if self.rng is None else "",
            "RNG states not from the start of the step" if self.rng is not None and rng_at != "step_start" else "",
        ) if text]
        ids = self.bundle.sample_ids
        # An integration's step: its ids number the rows across its micro-batches (nanscan.integrations.session)
        integrated = isinstance(self.batch, dict) and isinstance(self.batch.get(MICRO_BATCHES), list)
        self.sample_count = len(ids) if integrated and isinstance(ids, list) and ids else batch_size(self.batch, ids)
        self._rng_warned = False

    @property
    def state_description(self) -> str:
        if self.model_state is None:
            return "none (freshly built model)"
        return "pre-step snapshot" if self.pre_step else "at the failing step"

    def build(self) -> ReplaySpec:
        try:
            with bundle_imports(self.search):  # the classes of a zero-config recipe, searched as the entry was
                return build_spec(self.entry, self.bundle.config, from_bundle=self.entry_from_bundle)
        except EntryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user entry failing deserves its name in the message
            raise ReplayError(f"replay entry {self.entry!r} raised {type(exc).__name__}: {exc}") from exc

    def _restore_rng(self) -> None:
        if self.rng is None:
            # Not the original draws, but the same ones on every replay: otherwise each run draws other dropout
            # masks and the verdict (and the bisection) would depend on where the process's generators happen to be.
            torch.manual_seed(0)
            np.random.seed(0)
            random.seed(0)
            return
        try:
            restore_rng(self.rng)
        except RuntimeError as exc:  # recorded on a GPU, replayed without one
            restore_rng({**self.rng, "torch_cuda": []})
            if not self._rng_warned:
                self.notes.append(f"rng: CUDA generator states not restored ({exc})")
                self._rng_warned = True

    def prepare(self, options: StepOptions = StepOptions(), *, samples: Sequence[int] | None = None,
                batch: Any = None) -> tuple[ReplaySpec, torch.optim.Optimizer, Any]:
        """A fresh (spec, optimizer, batch) with the bundle's state loaded and `options` applied; RNGs restored."""
        spec, optimizer = self.build_at(self.model_state, self.optimizer_state, options)
        model = spec.model
        if options.lr_scale != 1.0:
            for group in optimizer.param_groups:
                if "lr" in group:  # an optimizer without a learning rate: run() says the factor was not in effect
                    group["lr"] = group["lr"] * options.lr_scale
        step_batch = self.batch if batch is None else batch
        if samples is not None:
            step_batch = select_samples(step_batch, samples, spec,
                                        size=self.sample_count if batch is None else None)
        step_batch = prepare_batch(step_batch, model_device(model), options)
        self._restore_rng()
        return spec, optimizer, step_batch

    def build_at(self, model_state: dict | None, optimizer_state: dict | None,
                 options: StepOptions = StepOptions()) -> tuple[ReplaySpec, torch.optim.Optimizer]:
        """A fresh spec and optimizer with `model_state` and `optimizer_state` loaded (the bundle's, or a state its
        window kept, which leaves the frozen parameters out: they are taken, checked, from the model the entry
        builds) and `options`' precision and eps applied."""
        spec = self.build()
        model = spec.model
        if self.frozen:  # before a precision change: the references are of the weights as the entry loads them
            self._take_frozen(model)
        if options.precision is not None:
            for t in [*model.parameters(), *model.buffers()]:
                if t.dtype in HALF_DTYPES:
                    t.data = t.data.float()
        if model_state is not None:
            # a window's state leaves the frozen parameters out: the bundle's state has them (or, by reference,
            # the entry's model, checked above)
            frozen = {key: value for key, value in (self.model_state or {}).items() if key not in model_state}
            try:
                model.load_state_dict({**model_state, **frozen})
            except RuntimeError as exc:
                raise ReplayError(f"the model built by {self.entry!r} does not match the state stored in "
                                  f"{self.bundle.path}: {exc}; use the entry (and config) of the run that wrote the "
                                  "bundle") from None
        try:
            optimizer = spec.make_optimizer()
        except EntryError:
            raise
        except Exception as exc:  # noqa: BLE001 - as in build(): the user's factory failing is named as such
            raise ReplayError(f"the optimizer factory of replay entry {self.entry!r} raised {type(exc).__name__}: "
                              f"{exc}") from exc
        if optimizer_state is not None:
            try:
                # a deep copy: load_state_dict may keep our tensors, and optimizer.step() updates them in place
                optimizer.load_state_dict(copy.deepcopy(optimizer_state))
            except (ValueError, KeyError, RuntimeError) as exc:
                raise ReplayError(f"the optimizer built by {self.entry!r} does not match the optimizer state in "
                                  f"{self.bundle.path}: {exc}") from None
        if options.eps is not None:  # after the state, whose param groups carry the run's eps
            for group in optimizer.param_groups:
                if "eps" in group:
                    group["eps"] = options.eps
        return spec, optimizer

    def _take_frozen(self, model: torch.nn.Module) -> None:
        """Check the frozen tensors the bundle holds by reference against those of the model the entry built, and
        complete the bundle's state with them (nanscan.bundle.frozen NOTE: [frozen references]); later runs load
        them from that state."""
        state = model.state_dict()
        differ, unchecked = compare(self.frozen, state)
        where, copy_hint = self.bundle.path, ("record them in the bundle with nanscan.Monitor(..., "
                                              "frozen_weights='copy')")
        if unchecked:
            raise ReplayError(f"{where} holds {len(self.frozen)} frozen tensor(s) by sha256 only, and the model built "
                              f"by {self.entry!r} cannot be checked against {len(unchecked)} of them "
                              f"({shown(unchecked)}): it lacks them or holds them on the meta device; build the "
                              f"model as the run did (its base weights loaded), or {copy_hint}")
        if differ:
            raise ReplayError(f"the frozen tensor(s) {shown(differ)} of the model built by {self.entry!r} differ from "
                              f"the run's (sha256, dtype or shape recorded in {where / 'manifest.json'}): the entry "
                              "loads other base weights than the run did (another checkpoint, revision or seed), or "
                              "the run changed them in place; a replay on them would answer for another model; "
                              f"load the run's base weights in the entry, or {copy_hint}")
        self.model_state = {**self.model_state, **{key: state[key].detach().clone() for key in self.frozen}}
        self.notes.append(f"frozen: {len(self.frozen)} frozen tensor(s) the bundle holds by sha256 were taken from "
                          f"the model built by {self.entry!r}, each matching its digest")
        self.frozen = {}

    def run(self, options: StepOptions = StepOptions(), *, samples: Sequence[int] | None = None, batch: Any = None,
            localize: bool = False, trace_ops: bool = False) -> StepOutcome:
        """Replay the step once (on `samples` of the saved batch, or on another `batch`) and return its outcome;
        `localize`: module hooks (outcome.localization), `trace_ops`: the op tracer (outcome.op_site)."""
        learning_rates: list[Any] = []
        ran: list[tuple[ReplaySpec, StepOptions]] = []

        def attempt(backward_module_hooks: bool) -> StepOutcome:
            spec, optimizer, step_batch = self.prepare(options, samples=samples, batch=batch)
            learning_rates[:] = [group.get("lr") for group in optimizer.param_groups]
            ran[:] = [(spec, loop_options(spec, options, self.autocast))]
            return run_step(spec.model, optimizer, spec.step_fn, step_batch, options=ran[0][1], localize=localize,
                            backward_module_hooks=backward_module_hooks, trace_ops=trace_ops)

        result = run_localized(attempt) if localize else attempt(True)
        if options.lr_scale != 1.0 and not any(lr for lr in learning_rates if lr is not None):
            result.notes.append(f"learning rate x{options.lr_scale:g} was not in effect: the optimizer's param groups "
                                "have no non-zero 'lr' to scale")
        if ran and result.error is None:
            self._check_precision(result, options, *ran[0])
        return result

    def _check_precision(self, result: StepOutcome, options: StepOptions, spec: ReplaySpec,
                         step_options: StepOptions) -> None:
        """Say whether the precision the step was to run in reached the model's forward (NOTE: [replayed
        precision]): a factor's that did not is "not in effect" (ablate then counts its row as not applied); the
        run's re-applied autocast that did not gets a note of its own, which no factor's row reads."""
        wanted = step_options.precision
        if not self._precision_said:
            self._precision_said = True
            recorded = recorded_precision(self.autocast)
            if recorded is not None:
                where = self.autocast.get("device_type")
                here = model_device(spec.model).type
                self.notes.append(
                    f"precision: the run's {recorded} autocast is not re-applied: the replay entry enters its own "
                    "(ReplaySpec.autocast='entry')" if spec.autocast == "entry" else
                    f"precision: the run's {recorded} autocast is re-applied around step_fn"
                    + (f" (recorded on {where}, entered on {here})" if where and where != here else ""))
        if wanted is None:
            return
        dtype = PRECISIONS[wanted]
        expected = None if dtype is None else str(dtype).removeprefix("torch.")
        got = result.autocast
        if got == expected:
            return
        if options.precision is None:  # the run's own region, re-applied
            result.notes.append(f"the run's {wanted} autocast, re-applied around step_fn, did not reach the forward: "
                                f"step_fn sets its own ({got or 'off'}); if the entry does so on purpose, declare it "
                                "with ReplaySpec(autocast='entry')")
        elif spec.autocast == "entry":
            result.notes.append(f"precision {options.precision} was not in effect: the replay entry enters its own "
                                f"autocast ({got or 'off'}; ReplaySpec.autocast='entry'), which a replay cannot "
                                "override")
        else:
            result.notes.append(f"precision {options.precision} was not in effect: step_fn sets its own autocast "
                                f"({got or 'off'}), which overrides the replay's")


def _refuse_zero_partitions(bundle: Bundle, optimizer_state: Any) -> None:
    """A DeepSpeed ZeRO bundle's optimizer state is each rank's fp32 master and moment fragments (NOTE: [zero
    partitions] in nanscan/integrations/deepspeed.py), and under ZeRO-3 its weights are flat partitions too, which
    no model an entry builds loads: refused with what it holds and what works, not a list of missing keys."""
    if not (isinstance(optimizer_state, dict) and "zero_stage" in optimizer_state):
        return
    stage = optimizer_state["zero_stage"]
    weights = ("each rank's flat partition of every weight (keys such as 'w@shard1/2')" if stage == 3 else
               "the whole bfloat16 or float16 weights, but the fp32 master weights and Adam moments only as each "
               "rank's fragments")
    raise ReplayError(f"{bundle.path} holds a DeepSpeed ZeRO-{stage} rank's state: {weights}, which nanscan cannot "
                      "rebuild into a model and optimizer in one process (nor yet rerun on the job's own ranks). "
                      "`nanscan report` and `nanscan triage` read what it holds: the failing tensors, named by "
                      "parameter and partition, and the history; the full weights are in the run's DeepSpeed "
                      "checkpoint (deepspeed.utils.zero_to_fp32)")
