"""The incident taxonomy, in one place: the tensor-name convention, the failure categories in the order they are
decided, what each category means, the error and warning a non-finite step raises, and the warning of a spike
(the early warning before it, nanscan.runtime.spikes).

Every module that names, parses or orders scanned tensors or categories asks here (the Monitor, distributed
agreement, the bundle, report, replay, preflight), so a new kind or category is added once.

NOTE: [tensor names]
The Monitor names what it scans by kind: `input:<path>` (the batch's floating tensors), `loss`, `param:<name>`,
`grad:<name>` and `optim:<param name>.<state key>`. FSDP2 shards add `@shard<i>/<n>` after the parameter name
(nanscan.runtime.distributed). Anything else (tensors given to nanscan.scan) is of kind "other".
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

# Decided in this order: the first kind holding a non-finite tensor names the category. Inputs and weights come
# first because everything computed from them inherits their NaNs; the loss before the gradients because a
# non-finite loss makes every gradient non-finite too.
CATEGORIES = ("input", "parameter", "optimizer_state", "loss", "gradient")
# A step can also go bad only in optimizer.step(): replay sees it, and so does the Monitor's post-update check
# (nanscan.runtime.update NOTE: [post-update check]), which dates it to the step whose update wrote it.
UPDATE = "update"
STEP_CATEGORIES = (*CATEGORIES, UPDATE)
# A report whose non-finite tensors follow no convention (nanscan.scan of the user's own tensors).
OTHER = "other"
# The category of a distributed part whose rank held only finite values at the failing step (another rank's
# were not).
OTHER_RANK = "other_rank"
# The category of an early-warning bundle: every value was finite, but the loss or the gradient norm jumped far out
# of its recent range (nanscan.runtime.spikes NOTE: [spike statistic]). Never a failure category: a spike is not the
# run's first invalid step, and nothing non-finite decides it.
SPIKE = "spike"
# The other rule behind a spike bundle (Spike.kind, nanscan.runtime.spikes NOTE: [growth rule]): the loss or the
# gradient norm kept gaining binades to a new high; it needs no window, so it speaks from the first steps.
GROWTH = "growth"
# The third (nanscan.runtime.spikes NOTE: [elevated rule]): the loss or the gradient norm jumped and stays up, several
# binades above its first step, for several finite steps in a row, without rising step after step.
ELEVATED = "elevated"
# Kinds of tensor in the order of the categories; a category names its own kind.
KINDS = (*CATEGORIES, OTHER)

# Why a step is an incident: a non-finite value at that step, or under a GradScaler a streak of overflow skips
# (nanscan.runtime.amp NOTE: [overflow skips]): the expected event OVERFLOW_SKIP, one skip, is no incident.
NONFINITE = "nonfinite"
SKIP_STREAK = "skip_streak"
OPTIMIZER_UPDATE = "optimizer_update"  # non-finite right after optimizer.step(), seen by the post-update check
# A batch tensor held finite values beyond the range the step computes in (NOTE: [overflow] in
# nanscan/engine/headroom.py) and the step then went non-finite in the loss or the gradients: category "input", the
# tensors those inputs.
INPUT_OVERFLOW = "input_overflow"
# Replicas that must be bit-identical were not (nanscan.runtime.distributed NOTE: [replica agreement]): every value
# may be finite. Both the category and the reason of such an incident; after the non-finite categories in
# category_rank, so a step that is non-finite too is categorised by its non-finite values.
REPLICA_MISMATCH = "replica_mismatch"
REASONS = (NONFINITE, SKIP_STREAK, OPTIMIZER_UPDATE, INPUT_OVERFLOW, REPLICA_MISMATCH)
OVERFLOW_SKIP = "overflow_skip"
REASON_EXPLANATIONS = {
    SKIP_STREAK: "GradScaler skipped every step from this one on: only gradients were non-finite (inputs, weights, "
                 "optimizer state and loss finite), the scaler halved its scale each time and no update was "
                 "applied. A healthy run settles after a few such skips; this streak did not, so the gradients "
                 "are non-finite whatever the scale (a backward-pass bug, not mixed-precision overflow).",
    INPUT_OVERFLOW: "A tensor of the batch held finite values beyond the range the step computes in (|x| >= 2**64, "
                    "whose squares overflow float32 and bfloat16; above 65504 under float16 autocast), and the "
                    "step then went non-finite: the data is the likely cause (3.4e38, float32's largest value, is a "
                    "common missing-value sentinel). `nanscan data` flags the same values as `overflow`.",
    OPTIMIZER_UPDATE: "The optimizer update of this step wrote the non-finite values: the batch, the loss, the "
                      "gradients, the weights and the optimizer state it read were finite, and the weights or the "
                      "state right after optimizer.step() were not. The cause is in the update itself: its settings "
                      "against the dtypes (an eps that is 0 in the parameters' dtype, a learning rate times a "
                      "gradient that overflows), or the size of the step; `nanscan replay` reruns it.",
}
# The verdicts of `nanscan replay` as its record in a bundle's ledger keys them, and in words. NOT_REPRODUCED keeps
# its stored key "transient", which says only that the rerun stayed finite, never why (nanscan.replay.reproduce
# NOTE: [not reproduced]): shown, it is "not reproduced by the replay entry".
PERSISTENT, NOT_REPRODUCED, INTERMITTENT = "persistent", "transient", "intermittent"
REPLAY_VERDICT_WORDS = {PERSISTENT: "persistent", NOT_REPRODUCED: "not reproduced by the replay entry",
                        INTERMITTENT: "intermittent"}
# How a finding's title names the reason, after the category (reason_title).
REASON_TITLES = {SKIP_STREAK: ", the first of a streak of skipped steps",
                 INPUT_OVERFLOW: ", finite inputs beyond the step's range"}

# NOTE: [tensor names] prefixes, by kind; the loss is one tensor named LOSS.
PREFIX = {"input": "input:", "parameter": "param:", "optimizer_state": "optim:", "gradient": "grad:"}
LOSS = "loss"
_KIND_OF_PREFIX = {prefix[:-1]: kind for kind, prefix in PREFIX.items()}

CATEGORY_EXPLANATIONS = {
    "input": "A tensor of the batch was already non-finite when it reached the model: the data (or its "
             "preprocessing) is the cause.",
    "parameter": "A weight was already non-finite before this step's update: an earlier update or an outside "
                 "write corrupted it.",
    "optimizer_state": "The optimizer state was non-finite while inputs and weights were finite: the optimizer's "
                       "moments or counters broke first.",
    "loss": "The loss was non-finite while inputs, weights and optimizer state were finite: something in the "
            "forward pass produced it.",
    "gradient": "The loss was finite but a gradient was not: something in the backward pass produced it.",
    UPDATE: "Every tensor checked before optimizer.step() was finite, but the update wrote non-finite weights or "
            "optimizer state.",
    SPIKE: "Every value was finite, but the loss or the gradient norm jumped far outside its recent range (or kept "
           "growing, by binades, to a new high): an early warning, kept while the weights are still sound. The "
           "tensors whose norms moved first point at the cause (one layer's gradients: that layer; every layer at "
           "once with the loss: the batch or the learning rate).",
    OTHER_RANK: "This rank's tensors were finite at this step, and any replicas it holds agreed; another rank's "
                "were not finite, or differed from their replicas: the bundle set's index (index.json, one directory "
                "up) names the rank that went bad first.",
    REPLICA_MISMATCH: "Tensors that a set of replicas must hold bit for bit (under DDP every rank's parameters, "
                      "optimizer state and, at a step's own check, all-reduced gradients; under ZeRO-1/2 the "
                      "low-precision weights; a DTensor's local tensor across the ranks it is replicated over, as "
                      "HSDP's replicate dimension) had different fingerprints on different ranks, whether or not any "
                      "value was non-finite: silent corruption of memory, compute or communication on the odd "
                      "rank(s). The bundle set's index names them (by majority with 3 or more replicas; with 2 it "
                      "cannot tell which), the first differing tensors, and whether the reduced gradients already "
                      "differed (the all-reduce or the compute around it) or only the parameters and optimizer state "
                      "(memory, or an earlier update on that rank); its ranks' rows name each rank's host and device, "
                      "so a machine that keeps appearing stands out in `nanscan triage`.",
}


def update_message(step: int) -> str:
    """How an incident of the post-update check names its cause."""
    return f"the optimizer update of step {step}"


def reason_title(reason: str | None, step: int) -> str:
    """What follows the category in a title ("(input, finite inputs beyond the step's range)"); "" for NONFINITE."""
    if reason == OPTIMIZER_UPDATE:
        return f", written by {update_message(step)}"
    return REASON_TITLES.get(reason, "")


def explain_category(category: str, *, loss_checked: bool = True, inputs_checked: bool = True,
                     batch_given: bool = False, batch_cause: str | None = None) -> str:
    """CATEGORY_EXPLANATIONS[category], worded for what was actually checked: `nanscan.check(model)` sees no loss
    and no batch, so a NaN from the forward pass first shows in the gradients and must not be called a backward
    pass failure, and "the inputs were finite" is not known. `batch_given`: a batch was passed whose tensors were
    all integers (token ids, labels), so nothing in it was scanned: none of it can be NaN, but it can still make
    one. `batch_cause`: what in the batch did (nanscan.engine.targets NOTE: [no supervised tokens]), named as the
    likely cause."""
    text = CATEGORY_EXPLANATIONS.get(category, "")
    if category == "gradient" and not loss_checked:
        text = ("A gradient was the first non-finite tensor checked; no loss was checked (none was given), so this "
                "cannot tell the forward pass from the backward pass: a non-finite loss makes every gradient "
                "non-finite too.")
    elif category == "loss" and not inputs_checked:
        text = "The loss was non-finite while weights and optimizer state were finite."
    elif category == "optimizer_state" and not inputs_checked:
        text = "The optimizer state was non-finite while the weights were finite: its moments or counters broke first."
    if batch_cause:
        text += f" Likely cause: {batch_cause}."
    elif category in ("parameter", "optimizer_state", "loss", "gradient") and not inputs_checked:
        text += (" The batch holds only integer tensors: none of them can be NaN, but targets that are all the "
                 "loss's ignore index would still make a mean loss 0/0." if batch_given else
                 " No batch was checked (none was given), so the inputs may have been non-finite already.")
    return text


def tensor_name(kind: str, body: str) -> str:
    """The scanned name of a tensor of `kind` (NOTE: [tensor names]): tensor_name("gradient", "fc.weight") is
    "grad:fc.weight"."""
    return PREFIX[kind] + body


def tensor_kind(name: str) -> str:
    """The kind of a scanned tensor from its name: input, parameter, optimizer_state, loss, gradient or other."""
    if name == LOSS:
        return LOSS
    prefix, sep, _ = name.partition(":")
    return _KIND_OF_PREFIX.get(prefix, OTHER) if sep else OTHER


def is_kind(name: str, kind: str) -> bool:
    """Whether a scanned name is of `kind` (cheaper than tensor_kind(name) == kind on the every-step path)."""
    return name == LOSS if kind == LOSS else name.startswith(PREFIX[kind])


def owner_module(name: str) -> str:
    """The module holding a parameter, gradient or optimizer-state tensor: "param:blocks.0.attn.qkv.weight" and
    "optim:blocks.0.attn.qkv.weight.exp_avg" -> "blocks.0.attn.qkv" (the state key after the parameter name is
    dropped)."""
    body = name.partition(":")[2]
    if is_kind(name, "optimizer_state"):
        body = body.rpartition(".")[0]
    return body.rpartition(".")[0]


def layer_of(name: str) -> str:
    """The layer holding a parameter, gradient or optimizer-state tensor: its module path up to the first index
    ("grad:blocks.0.attn.qkv.weight" -> "blocks.0"), else the module's first component ("grad:head.weight" ->
    "head"); the tensor's own name for the loss, batch tensors and other names."""
    module = owner_module(name) if tensor_kind(name) in PREFIX.keys() - {"input"} else ""
    return module_layer(module) if module else name


def module_layer(module: str) -> str:
    """A module path's layer: up to its first index ("blocks.0.attn.qkv" -> "blocks.0"), else its first
    component ("head.proj" -> "head")."""
    parts = module.split(".")
    return ".".join(parts[: next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 1)])


def category_rank(category: str) -> int:
    """Where a category stands in the order of decision (earlier: closer to the cause); unknown ones last."""
    return KINDS.index(category) if category in KINDS else len(KINDS)


def categorize(report: Any) -> tuple[str | None, list[str]]:
    """(category, deciding tensor names) of a scan report (anything with `.nonfinite` names); (None, []) when it
    is finite. A report whose non-finite tensors follow no convention is categorised "other"."""
    bad = report.nonfinite
    if not bad:
        return None, []
    by_kind: dict[str, list[str]] = {}
    for name in bad:
        by_kind.setdefault(tensor_kind(name), []).append(name)
    for category in CATEGORIES:
        if category in by_kind:
            return category, by_kind[category]
    return OTHER, bad


def shown_names(names: Sequence[str], limit: int = 5) -> str:
    """The first `limit` names and how many more, for a one-line message."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


class NonFiniteError(RuntimeError):
    """A training step produced a NaN or infinity (raised by Monitor.check with on_invalid="raise").

    `bundle_path` is the evidence bundle of the run's first incident (None if it could not be written), `step`
    and `category` describe the step that raised, `tensors` the non-finite tensors that decided the category.
    """

    def __init__(self, message: str, *, bundle_path: Path | None, step: int, category: str, tensors: list[str]):
        super().__init__(message)
        self.bundle_path = bundle_path
        self.step = step
        self.category = category
        self.tensors = tensors


class NonFiniteWarning(RuntimeWarning):
    """Issued once, at the first non-finite step, by Monitor.check with on_invalid="warn" or "skip"."""


class GradientWarning(UserWarning):
    """A check saw no gradient where the model has parameters that train: it runs at the wrong moment."""


class SnapshotWarning(UserWarning):
    """snapshot="cpu" was asked for, but a check came with no step start before it (nanscan.Monitor.begin_step)."""


class SpikeWarning(UserWarning):
    """A step whose loss or gradient norm jumped far outside its recent range while every value was finite: the
    early warning before a divergence (nanscan.runtime.spikes). Issued by Monitor.check with spikes="warn", "bundle" or
    "skip", raised with spikes="raise".

    `step`: the spiking step. `quantity`: what spiked most ("loss" or "grad_norm"). `spike`: the full
    nanscan.runtime.spikes.Spike (every quantity past the rule, how far out, the first-moving tensors by layer).
    `bundle_path`: the spike bundle (category SPIKE) when one was written for it, else None.
    """

    def __init__(self, message: str, *, step: int, quantity: str, spike: Any, bundle_path: Path | None = None):
        super().__init__(message)
        self.step = step
        self.quantity = quantity
        self.spike = spike
        self.bundle_path = bundle_path


def warn_user(message: str | Warning, category: type[Warning] = NonFiniteWarning) -> None:
    """Warn with the location of the first caller outside nanscan (the user's check call). `message` may be a
    Warning instance (a SpikeWarning with its fields), whose own class is then the category."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package_dir + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
