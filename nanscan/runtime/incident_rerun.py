"""Monitor(step_fn=...): the failing step rerun inside the training process at its incident, localized to the first
bad module, op and source line as `nanscan replay` does, with nothing of the run changed (NOTE: [in-process rerun]).

NOTE: [in-process rerun]
A script-style loop (nanoGPT's train.py) cannot be imported without training, so a replay entry for it rebuilds the
model, the data and the autocast by hand, and drifts. At the incident the process itself holds all of it but the
forward, which `step_fn(model, batch) -> loss` gives (a closure over the script's own objects). Once the incident's
bundle is written (the evidence first: a rerun that fails or stalls loses nothing), before on_invalid acts, the
Monitor reruns the failing step through nanscan.runtime.rerun.run_step with the module hooks
(nanscan.runtime.localize), then, while under the time limit, once more with the op tracer (nanscan.runtime.ops
NOTE: [op localization]), and adds the result to the bundle as the finding nanscan.bundle.format.RERUN_FINDING
(ledger and INCIDENT.md; the manifest names the step_fn) and to the error's message.

It starts from the step's own state without copying it: at a check decided before optimizer.step() (mode="sync",
a micro-batch check, an observed micro-batch) the weights and optimizer state are still those the step started
from. A verdict read later (mode="async") has seen the update, so the rerun loads snapshot="cpu"'s copy of the
step's start, setting the live weights aside on the host; without that copy it does not run, and says why.

Nothing the loop holds changes: every gradient is set aside (by reference) and put back, the buffers a forward in
training mode updates (BatchNorm's statistics) are copied and restored, each module keeps its train/eval mode, the
RNG streams are taken before and restored after (the loop's random stream goes on as if no rerun happened), and the
Monitor's step-start hook is disarmed. The rerun draws from the RNG states taken at the step's start (the same
dropout masks as the failing forward; for a micro-batch after the first, the masks differ, and the finding says
so), under the autocast region recorded for the step (nanscan.runtime.rerun_inputs NOTE: [replayed precision]: a step_fn
that enters its own region overrides it), with the run's own kernels (not deterministic algorithms: the question
is whether this step, as the run computes it, fails). Without an optimizer step: the rerun ends at the gradients.

A rerun that stays finite is "not reproduced by the rerun": the cause is outside the forward and backward step_fn
gives (code in the loop between its forward and the check, a batch other than the one the model was fed,
nondeterministic kernels), never the hardware without evidence (nanscan.replay.reproduce NOTE: [not reproduced]).
Under a process group only the ranks whose own tensors went bad rerun, on the plain module (a DDP wrapper's reducer
is not involved, so no collective runs); sharded weights (FSDP, DTensor) cannot be rerun on one rank of several and
are not (on a group of one rank, the sharded module's collectives involve no other rank: it reruns).
A time limit (`rerun_timeout`, seconds) is checked between the phases: the module pass always runs, the op pass
only within the limit. An exception inside the rerun becomes the finding's error; the incident itself is unchanged.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from nanscan.bundle.provenance import capture_rng, restore_rng, restore_rng_sources
from nanscan.bundle.tree import map_tree
from nanscan.engine.fingerprint import compare_rerun
from nanscan.engine.targets import targets_cause
from nanscan.incident import LOSS
from nanscan.runtime.localize import OP_PHASES, Localization, fmt_value
from nanscan.runtime.ops import OpSite, op_markdown
from nanscan.runtime.rerun import StepOutcome, recorded_precision, run_localized, run_step
from nanscan.runtime.step_options import StepOptions

DEFAULT_TIMEOUT_S = 120.0
# What a rerun in the process cannot see, each with what would tell it apart (NOTE: [in-process rerun]).
UNSEEN_IN_PROCESS = (
    ("code in the loop outside step_fn: a hook that fired once, an in-place edit of the weights, gradients or batch "
     "between the forward and the check",
     "look at what the loop does to the model and its gradients between loss.backward() and check()"),
    ("a difference in the data pipeline: the model was fed other tensors than the batch given to check() (a "
     "transform, a cast or a device move after it)",
     "give check() the very tensors the forward receives"),
    ("nondeterministic kernels: atomic adds, the order of a reduction, autotuned algorithms",
     "a deterministic rerun (`nanscan replay` with an entry, or the run with torch.use_deterministic_algorithms)"),
)
# A rank of a process group also cannot see the others (NOTE: [in-process rerun]).
OTHER_RANKS = ("another rank: DDP averages the gradients over the ranks after backward, so a fault on one rank "
               "reaches every rank's gradients",
               "the bundle set's index names the first bad rank, whose part holds its own rerun")
NOT_HARDWARE = "Nothing here points at the hardware: a rerun that stays finite is no evidence of a hardware fault."
NEEDS_ENTRY = ("`nanscan replay` and `nanscan ablate` run outside this process and need a replay entry that rebuilds "
               "the model (nanscan.entry); this rerun needed none")


@dataclass
class RerunResult:
    """What the in-process rerun found: `verdict` "reproduced", "not reproduced", "not run" (why: `reason`) or
    "error" (the rerun raised: `error`)."""

    step: int
    step_fn: str
    verdict: str
    reason: str | None = None
    outcome: StepOutcome | None = None
    localization: Localization | None = None
    op: OpSite | None = None
    cause: dict | None = None
    error: str | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    in_group: bool = False  # one rank of a process group: OTHER_RANKS is among what the rerun cannot see
    # the rerun against the checked step, bit for bit (nanscan.engine.fingerprint NOTE: [bit-exact rerun]): the
    # tensors compared, and the first that differs ({"name", "detail", "finite_in_both"}) or None
    bitwise: dict | None = None
    # Where the step's starting state came from: "live" (the model and optimizer, not updated yet) or "snapshot"
    # (snapshot="cpu"'s copy, loaded for the rerun: the verdict came after the update).
    state: str = "live"
    grad_scale: float | None = None  # the run's GradScaler scale the step was rerun at (NOTE: [replayed scaling])

    @property
    def reproduced(self) -> bool:
        return self.verdict == "reproduced"

    def headline(self) -> str:
        """One line: the error message's and the finding's title."""
        if self.verdict == "not run":
            return f"not run: {self.reason}"
        if self.verdict == "error":
            return f"failed: {self.error}"
        if not self.reproduced:
            return ("not reproduced by the rerun: the cause is outside the forward and backward that step_fn "
                    f"gives ({self.step_fn})")
        parts = [f"reproduced ({self.outcome.category})"]
        loc = self.localization
        if loc is not None:
            if loc.overflow_began is not None:
                began = loc.overflow_began
                parts.append(f"overflow began in {began.label} ({began.module_type}): {began.detail}")
            parts.append(f"first bad: {loc.label} ({loc.module_type}, {loc.phase})")
        if self.op is not None:
            parts.append(f"op {self.op.op}{f' at {self.op.location}' if self.op.location else ''}")
        if self.cause is not None:
            parts.append(f"cause: {self.cause['short']}")
        return "; ".join(parts)

    def markdown(self) -> str:
        # No timing here: the same incident rerun again gives the same text (its seconds are in the record).
        source = "snapshot='cpu''s copy of" if self.state == "snapshot" else "the live model and optimizer, still at"
        lines = [f"Step {self.step} rerun in the training process through `{self.step_fn}` at the incident, from "
                 f"{source} the state the step started from, under the recorded autocast."]
        if self.verdict == "not run":
            lines += ["", f"The rerun did not run: {self.reason}."]
        elif self.verdict == "error":
            lines += ["", f"The rerun failed (the evidence above stands): `{self.error}`"]
        elif not self.reproduced:
            lines += ["", f"The rerun stayed finite (loss {fmt_value(self.outcome.loss)}): what step_fn runs does not "
                          "make this failure from this state and batch. It cannot see the following; each is named "
                          "with what would tell it apart:"]
            lines += [f"- {candidate}; to tell it apart: {tells}" for candidate, tells in self.unseen()]
            lines += ["", NOT_HARDWARE]
        else:
            if self.cause is not None:
                lines += ["", f"**Cause:** {self.cause['text']}."]
            if self.localization is not None:
                lines += ["", *self.localization.markdown_lines()]
            if self.op is not None:
                lines += ["", op_markdown(self.op)]
        if self.bitwise is not None:
            first = self.bitwise["first_difference"]
            lines += ["", f"**Bit for bit:** {self.bitwise['compared']} tensors compared with the check's: "
                          + ("the rerun gave the recorded bits." if first is None else
                             f"the rerun first differs at `{first['name']}` ({first['detail']}).")]
        lines += [f"- note: {n}" for n in ([""] if self.notes else []) + self.notes if n]
        lines += ["", f"Next: {NEEDS_ENTRY}."]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        # The replay finding's shape where they share a meaning (verdict, localization, op, cause), so that reports
        # and triage read either (nanscan.bundle.findings).
        return {"step": self.step, "step_fn": self.step_fn, "verdict": self.verdict, "state": self.state,
                "reproduced": self.reproduced, "reason": self.reason, "error": self.error,
                "seconds": round(self.seconds, 3),
                "category": self.outcome.category if self.outcome is not None else None,
                "localization": self.localization.to_dict() if self.localization else None,
                "op": self.op.to_dict() if self.op else None, "cause": dict(self.cause) if self.cause else None,
                "notes": list(self.notes), "bitwise": self.bitwise, "grad_scale": self.grad_scale,
                "unseen": [{"candidate": c, "tells_apart": t} for c, t in self.unseen()]}

    def unseen(self) -> list[tuple[str, str]]:
        """What a finite rerun could not see, each with what would tell it apart; [] unless not reproduced."""
        if self.verdict != "not reproduced":
            return []
        return ([OTHER_RANKS] if self.in_group else []) + list(UNSEEN_IN_PROCESS)


def function_name(fn: Callable) -> str:
    """`module:qualname` of a step_fn, as the manifest and the finding name it."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


@contextlib.contextmanager
def set_aside(model: torch.nn.Module, optimizer: Any, state: tuple[dict, dict | None] | None, *,
              weights: bool = False) -> Iterator[Callable[[], None]]:
    """Everything a rerun changes, put back afterwards (NOTE: [in-process rerun]): the gradients (by reference),
    the buffers (copied), the modules' train/eval modes, the tensors' dtypes, the RNG streams, and with `state`
    (the step's start, from snapshot="cpu") the weights and optimizer state, which it loads after setting the live
    ones aside on the host; `weights`: the live weights too, set aside on the host without loading anything (a
    rerun that updates them: NOTE: [in-process diagnosis]). Yields a function that puts the buffers back to the
    step's start, for each pass to begin from them (a forward in training mode moves BatchNorm's statistics)."""
    params = list(model.parameters())
    if optimizer is not None:
        seen = {id(p) for p in params}
        params += [p for g in optimizer.param_groups for p in g["params"] if id(p) not in seen]
    grads = [(p, p.grad) for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    dtypes = [(t, t.dtype) for t in [*params, *model.buffers()]]
    rng = capture_rng()
    live = None
    if state is not None or weights:
        live = ({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                map_tree(optimizer.state_dict(), lambda _, t: t.detach().to("cpu", copy=True))
                if optimizer is not None and state is not None else None)
    if state is not None:
        model.load_state_dict(state[0], strict=False)
        if optimizer is not None and state[1] is not None:
            optimizer.load_state_dict(state[1])
    start = [(b, b.detach().clone()) for b in model.buffers()] if state is not None else buffers

    def reset_buffers() -> None:
        with torch.no_grad():
            for b, kept in start:
                b.copy_(kept)

    try:
        yield reset_buffers
    finally:
        with torch.no_grad():
            for t, dtype in dtypes:  # a precision factor's float32 copies, back to the run's dtypes
                if t.dtype != dtype:
                    t.data = t.data.to(dtype)
        if live is not None:
            model.load_state_dict(live[0], strict=False)
            if optimizer is not None and live[1] is not None:
                optimizer.load_state_dict(live[1])
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
        for p, g in grads:
            p.grad = g
        for m, training in modes:
            m.train(training)
        restore_rng(rng)


def rerun_step(model: torch.nn.Module, optimizer: Any, step_fn: Callable, batch: Any, *, step: int,
               rng: dict | None, autocast: Any, micro_batch: int | None, state: tuple[dict, dict | None] | None,
               timeout: float, in_group: bool = False, checked: Any = None,
               gradients_comparable: bool = False, grad_scale: float | None = None) -> RerunResult:
    """Rerun the failing step in the process (NOTE: [in-process rerun]): the module pass, then the op pass within
    `timeout` seconds; `rng`: the step-start RNG states (None when not taken); `state`: the step's starting state
    to load first (a verdict read after the update), None when the live state is the step's own; `in_group`: one
    rank of a process group; `checked`: the check's ScanReport, compared bit for bit with the rerun (its gradients
    only where `gradients_comparable`: a step checked once, unscaled); `grad_scale`: the run's GradScaler scale at
    the step, under which the rerun scales its loss and unscales its gradients as the loop did (NOTE: [replayed
    scaling]: in float16 the scale decides which gradients overflow)."""
    name = function_name(step_fn)
    began = time.monotonic()
    result = RerunResult(step, name, "error", state="live" if state is None else "snapshot", in_group=in_group,
                         grad_scale=grad_scale)
    options = StepOptions(precision=recorded_precision(autocast))
    if grad_scale is not None:
        result.notes.append(f"rerun under the run's GradScaler at the step's scale, {grad_scale:g}: the loss scaled "
                            "before its backward and the gradients unscaled, as the loop did")
    if rng is None:
        result.notes.append("the RNG states of the step's start were not taken (no training forward was seen): "
                            "random draws (dropout) differ from the failing forward's")
    elif micro_batch:
        result.notes.append(f"the RNG states are those of the step's start, before micro-batch 0: micro-batch "
                            f"{micro_batch}'s random draws (dropout) differ from its failing forward's")

    def attempt(backward_module_hooks: bool, *, trace_ops: bool = False) -> StepOutcome:
        reset_buffers()
        if rng is not None:  # the sources the step's start took (torch's, at least)
            restore_rng_sources(rng)
        return run_step(model, None, step_fn, batch, options=options, localize=not trace_ops,
                        backward_module_hooks=backward_module_hooks, trace_ops=trace_ops, train=False,
                        grad_scale=grad_scale)

    try:
        with set_aside(model, optimizer, state) as reset_buffers:
            outcome = run_localized(attempt)
            result.outcome = outcome
            if checked is not None and outcome.error is None:
                compared, left_out = compare_rerun(checked.stats, outcome.scanned(), gradients=gradients_comparable)
                first = compared.first_difference
                result.bitwise = {"compared": compared.compared, "differences": len(compared.differences),
                                  "left_out": left_out, "first_difference": None if first is None else first.to_dict()}
            if outcome.error is not None:
                result.error = outcome.error
            elif outcome.finite:
                result.verdict = "not reproduced"
            else:
                result.verdict = "reproduced"
                result.localization = outcome.localization
                result.notes += [n for n in outcome.notes if n not in result.notes]
                if outcome.localization is not None and outcome.localization.phase in OP_PHASES:
                    if time.monotonic() - began < timeout:
                        result.op = attempt(True, trace_ops=True).op_site
                    else:
                        result.notes.append(f"the op pass was left out: the module pass took "
                                            f"{time.monotonic() - began:.1f} s of the {timeout:g} s limit "
                                            "(Monitor(rerun_timeout=...))")
                if outcome.category in (LOSS, "gradient"):
                    scope = "the batch" if micro_batch is None else f"micro-batch {micro_batch}"
                    result.cause = targets_cause([(scope, batch)], result.op.op if result.op is not None else None)
    except Exception as exc:  # noqa: BLE001 - the rerun is a diagnostic: its failure is reported, never raised
        result.verdict, result.error = "error", f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - began
    return result
