"""`replay`: reproduce a bundle's failing step through the replay entry, tell persistent from intermittent (and say
what a rerun that stays finite cannot see), localize, name a batch whose targets are all ignored, bisect, and
record the finding in the bundle.

NOTE: [not reproduced]
A rerun that stays finite shows only that the replay entry, run on the recorded state, batch and RNG states, does
not make the failure. It is "not reproduced by the replay entry" (the record keeps the key "transient"), never a
verdict on the cause: the rerun cannot see code in the training script outside the entry (a hook, an in-place
edit), a difference between the batch the model was fed and the one given to check(), nondeterministic kernels
(the replay runs deterministic algorithms), or the hardware. The verdict names each (UNSEEN_BY_RERUN) with what
would tell it apart, and a replay that did not start from the exact recorded conditions names those first. The
hardware is never the conclusion: a finite rerun is no evidence pointing at it.
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from nanscan.bundle import Bundle, load_bundle
from nanscan.bundle.format import REPLAY_FINDING
from nanscan.replay.bisect import BisectResult, bisect_samples
from nanscan.runtime.localize import OP_PHASES, Localization, fmt_value
from nanscan.engine.fingerprint import compare_rerun, compare_scans
from nanscan.engine.targets import targets_cause
from nanscan.incident import (INTERMITTENT, LOSS, NOT_REPRODUCED, PERSISTENT, REPLAY_VERDICT_WORDS, UPDATE,
                              is_kind)
from nanscan.integrations.rebuild import MICRO_BATCHES
from nanscan.runtime.ops import OpSite, op_markdown
from nanscan.runtime.traps import BREAKS, optimizer_traps
from nanscan.replay.options import DEFAULT_RUNS
from nanscan.replay.replayer import Replayer
from nanscan.replay.step import ReplayError, StepOptions, StepOutcome


@dataclass
class ReplayResult:
    bundle: str
    run_id: str
    step: int
    bundle_category: str
    entry: str
    state: str  # "pre-step snapshot", "at the failing step" or "none (freshly built model)"
    reproduced: bool
    verdict: str  # "persistent", "transient" (not reproduced: NOTE: [not reproduced]) or "intermittent"
    runs: list[StepOutcome]
    localization: Localization | None
    bisect: BisectResult | None
    op: OpSite | None = None  # the first op or autograd node that went non-finite (NOTE: [op localization])
    update: dict | None = None  # an update that went non-finite: what it broke and its traps (update_finding)
    notes: list[str] = field(default_factory=list)
    inexact: list[str] = field(default_factory=list)  # what the replay could not rebuild (Replayer.inexact)
    # An optional phase (localization, bisection) that raised: {"phase", "error"}; what the others found stands.
    phase_errors: list[dict] = field(default_factory=list)
    # What in the batch made the failure (NOTE: [no supervised tokens] in nanscan/engine/targets.py): the text and
    # {"scope", "path", "count", "ignore_index"}; None when nothing in it is known to.
    cause: dict | None = None
    # The reruns against the recorded step, bit for bit (bitwise_record; NOTE: [bit-exact rerun] in
    # nanscan/engine/fingerprint.py); None when nothing could be compared.
    bitwise: dict | None = None

    @property
    def failing_run(self) -> StepOutcome | None:
        """The first replay that went non-finite, None when none did."""
        return next((r for r in self.runs if not r.finite and r.error is None), None)

    @property
    def same_category(self) -> bool:
        failing = self.failing_run
        return failing is not None and failing.category == self.bundle_category

    def to_dict(self) -> dict:
        return {"bundle": self.bundle, "run_id": self.run_id, "step": self.step,
                "bundle_category": self.bundle_category, "entry": self.entry, "state": self.state,
                "reproduced": self.reproduced, "verdict": self.verdict, "same_category": self.same_category,
                "runs": [r.to_dict() for r in self.runs],
                "localization": self.localization.to_dict() if self.localization else None,
                "op": self.op.to_dict() if self.op else None, "update": self.update,
                "bisect": self.bisect.to_dict() if self.bisect else None, "notes": list(self.notes),
                "inexact": list(self.inexact), "phase_errors": [dict(e) for e in self.phase_errors],
                "cause": dict(self.cause) if self.cause else None, "bitwise": self.bitwise,
                "unseen": [{"candidate": c, "tells_apart": t} for c, t in self.unseen()]}

    def unseen(self) -> list[tuple[str, str]]:
        """What the rerun cannot see, each with what would tell it apart (NOTE: [not reproduced]); [] when the
        failure came back."""
        if self.reproduced:
            return []
        inexact = [(f"the conditions the replay could not rebuild exactly ({', '.join(self.inexact)}): a failure "
                    "that depends on them can vanish on replay", EXACT_REPLAY)] if self.inexact else []
        return inexact + list(UNSEEN_BY_RERUN)

    def headline(self) -> str:
        failing = self.failing_run
        if failing is None:
            text = (f"{REPLAY_VERDICT_WORDS[NOT_REPRODUCED]}: step {self.step} rerun through {self.entry} is finite "
                    f"{len(self.runs)} time(s) out of {len(self.runs)}")
            if self.inexact:
                text += f", but from inexact conditions ({', '.join(self.inexact)})"
            return text
        where = f"; first bad: {self.localization.label} ({self.localization.module_type}, " \
                f"{self.localization.phase})" if self.localization else ""
        if self.op is not None:
            where += f"; op {self.op.op}{f' at {self.op.location}' if self.op.location else ''}"
        if self.update is not None:
            traps = [t for t in self.update["traps"] if t["severity"] == BREAKS]
            where += f"; the update broke {self.update['broken_count']} tensor(s)"
            if traps:  # the problem's first clause: "eps rounds to 0 in float16"
                where += f"; {traps[0]['setting']}={traps[0]['value']:g}: {traps[0]['problem'].split(' (')[0]}"
        if self.cause is not None:
            where += f"; cause: {self.cause['short']}"
        if self.bitwise is not None:
            where += f"; {self.bitwise['short']}"
        if self.verdict == INTERMITTENT:
            bad = sum(1 for r in self.runs if not r.finite and r.error is None)
            return f"reproduced {bad} time(s) out of {len(self.runs)}, intermittent: {failing.category}{where}"
        return f"reproduced, {self.verdict}: {failing.category}{where}"

    def explanation(self) -> str:
        """What the verdict means, limited to what these replays can show (NOTE: [not reproduced])."""
        text = VERDICT_EXPLANATIONS[self.verdict]
        if self.cause is not None:
            text = f"Cause: {self.cause['text']}. {text}"
        unseen = self.unseen()
        if unseen:
            text += "\n" + "\n".join(f"- {candidate}; to tell it apart: {tells}" for candidate, tells in unseen)
            text += f"\n\n{NOT_HARDWARE}"
        return text



VERDICT_EXPLANATIONS = {
    PERSISTENT: "The same failure came back on every replay: the cause is in the code, the data or the state, "
                "and the replay can be used to find it.",
    NOT_REPRODUCED: "The step, rerun through the replay entry from the recorded state, batch and RNG states, "
                    "stayed finite: what the entry runs does not make this failure from these inputs. A rerun "
                    "cannot see the following; each is named with what would tell it apart:",
    INTERMITTENT: "The failure came back on some replays but not all (or differently): the step is not "
                  "deterministic here; look for races, atomics, or non-deterministic kernels.",
}
# NOTE: [not reproduced]: what a rerun through the entry cannot see, each with what would tell it apart.
UNSEEN_BY_RERUN = (
    ("code in the training script outside the replay entry: a hook, an in-place edit of the weights, gradients or "
     "batch, whatever the loop does between its forward and the check that step_fn does not",
     "rerun the step in the training process with the loop's own forward and backward"),
    ("a difference in the data pipeline: the model was fed other tensors than the batch given to check() (a "
     "transform, a cast or a device move after it)",
     "give check() the very tensors the forward receives"),
    ("nondeterministic kernels: atomic adds, the order of a reduction, autotuned algorithms (this replay runs "
     "deterministic algorithms)",
     "a deterministic rerun (the run itself with torch.use_deterministic_algorithms(True), up to this step)"),
    ("the hardware: a bad GPU or memory",
     "the same rerun on another device, once the candidates above are ruled out"),
)
EXACT_REPLAY = ("a Monitor with snapshot='cpu' on the model the step runs keeps the state and RNG states of the start "
                "of the step, for an exact replay")
NOT_HARDWARE = "Nothing here points at the hardware: a rerun that stays finite is no evidence of a hardware fault."


def verdict_of(outcomes: Sequence[StepOutcome]) -> str:
    # a run that raised an error showed nothing about the failure, but differs from one that ran
    failing = [not o.finite and o.error is None for o in outcomes]
    if not any(failing):
        return NOT_REPRODUCED
    if all(failing) and all(o.signature == outcomes[0].signature for o in outcomes):
        return PERSISTENT
    return INTERMITTENT


def replay(bundle: Bundle | str | os.PathLike, entry: str | None = None, *, runs: int = DEFAULT_RUNS,
           bisect: bool = True, progress: Callable[[str], None] | None = None,
           trust_bundle_paths: bool = False) -> ReplayResult:
    """Replay the bundle's failing step `runs` times (deterministic algorithms on), classify the failure as
    persistent, transient or intermittent, localize the first bad module with hooks, and bisect the batch.

    `entry` overrides the bundle's replay entry; trust_bundle_paths: as for Replayer. Nothing is written; see
    record_replay.
    """
    if runs < 1:
        raise ValueError(f"runs={runs}: replay at least once")
    say = progress or (lambda _msg: None)
    replayer = Replayer(bundle, entry, trust_bundle_paths=trust_bundle_paths)
    options = StepOptions(deterministic=True)
    outcomes = []
    for i in range(runs):
        say(f"replay {i + 1}/{runs}")
        outcomes.append(replayer.run(options))
        if i == 0 and outcomes[0].error is not None:
            # An error is not the failure being replayed: the entry does not run on this bundle's batch and state.
            raise ReplayError(f"the replayed step of {replayer.bundle.path} raised an error instead of running: "
                              f"{outcomes[0].error}; fix the replay entry {replayer.entry!r} (or pass --entry) so "
                              "that it runs the recorded batch")
    verdict = verdict_of(outcomes)
    failing = next((o for o in outcomes if not o.finite and o.error is None), None)
    reproduced = failing is not None
    localization = None
    op = update = None
    bisected = None
    phase_errors: list[dict] = []

    def optional(phase: str, run: Callable[[], Any]) -> Any:
        """An optional phase's result, or None with its error kept: it never discards what the others found."""
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - reported beside the results (replay --json: phase_errors)
            phase_errors.append({"phase": phase, "error": f"{type(exc).__name__}: {exc}"})
            return None

    if reproduced:
        say("localizing with module hooks")
        localized = optional("localization", lambda: replayer.run(options, localize=True))
        if localized is not None:
            localization = localized.localization
            failing.notes.extend(n for n in localized.notes if n not in failing.notes)
        if localization is not None and localization.phase in OP_PHASES:
            say("localizing the op")
            traced = optional("op localization", lambda: replayer.run(options, trace_ops=True))
            op = traced.op_site if traced is not None else None
        if failing.category == UPDATE:
            say("checking the update")
            update = optional("update check", lambda: update_finding(replayer, options, failing))
        if bisect and verdict == "persistent":
            say("bisecting the batch")
            bisected = optional("bisection", lambda: bisect_samples(replayer, options))
        elif bisect:
            bisected = BisectResult(False, batch_size=replayer.sample_count,
                                    reason=f"the failure is {verdict}, so a subset's result would not be reliable")
    cause = batch_cause(replayer, op) if reproduced and failing.category in (LOSS, "gradient") else None
    bitwise = optional("bit-exact comparison", lambda: bitwise_record(replayer, outcomes, options))
    notes = list(replayer.notes)
    if reproduced and failing.category != replayer.bundle.category:
        notes.append(f"the bundle's category is {replayer.bundle.category}, the replay first saw non-finite "
                     f"values as {failing.category}")
    return ReplayResult(str(replayer.bundle.path), replayer.bundle.manifest["run_id"], replayer.bundle.step,
                        replayer.bundle.category, replayer.entry, replayer.state_description, reproduced, verdict,
                        outcomes, localization, bisected, op, update, notes, list(replayer.inexact), phase_errors,
                        cause, bitwise)


def bitwise_record(replayer: Replayer, outcomes: Sequence[StepOutcome], options: StepOptions) -> dict | None:
    """The reruns against the recorded step, tensor by tensor (NOTE: [bit-exact rerun] in
    nanscan/engine/fingerprint.py): "reproduced bit for bit", or the first tensor that differs, and whether the
    deterministic reruns agree with each other and with one rerun without deterministic algorithms (which tells the
    kernels' nondeterminism from the rest). None when the bundle holds no fingerprints or no rerun ran."""
    bundle = replayer.bundle
    entry = next((e for e in bundle.history() if e.step == bundle.step), None)
    runs = [o for o in outcomes if o.error is None]
    if entry is None or not runs or all(s.fingerprint is None for s in entry.report.stats):
        return None
    batch = replayer.batch
    left_out, gradients = [], True
    if bundle.micro_batch is not None or bundle.manifest.get("micro_batch_observed") or (
            isinstance(batch, dict) and isinstance(batch.get(MICRO_BATCHES), list) and len(batch[MICRO_BATCHES]) > 1):
        gradients = False
        left_out.append("the loss and the gradients (the record's sum over the step's micro-batches)")
    scaling = entry.report.scaling
    if gradients and scaling is not None and getattr(scaling, "scale", 1.0) not in (None, 1.0):
        gradients = False
        left_out.append(f"the loss and the gradients (recorded scaled by the GradScaler, scale {scaling.scale:g})")
    first, more = compare_rerun(entry.report.stats, runs[0].scanned(), gradients=gradients)
    left_out += more
    agree = all(compare_scans(runs[0].scanned(), o.scanned()).equal for o in runs[1:])
    record = {"compared": first.compared, "equal": first.equal, "differences": len(first.differences),
              "left_out": left_out, "reruns": len(runs), "reruns_agree": agree, "nondeterministic_rerun_agrees": None,
              "first_difference": None, "points_at": None}
    if first.equal:
        record["short"] = f"bit for bit ({first.compared} tensors)"
        return record
    diff = first.first_difference
    record["first_difference"] = diff.to_dict()
    record["short"] = f"the rerun first differs at {diff.name} ({diff.detail})"
    if replayer.inexact:
        record["not_judged"] = f"the replay's conditions were inexact ({', '.join(replayer.inexact)})"
    elif agree:
        loose = replayer.run(dataclasses.replace(options, deterministic=False))
        same = loose.error is None and compare_scans(runs[0].scanned(), loose.scanned()).equal
        record["nondeterministic_rerun_agrees"] = same
        record["points_at"] = "code outside the rerun, or the hardware" if same else "nondeterministic kernels"
    return record


def bitwise_markdown(record: dict) -> str:
    """The bit-exact comparison as INCIDENT.md shows it."""
    if record["equal"]:
        text = (f"**Bit for bit:** the rerun reproduced the recorded step exactly: {record['compared']} tensors "
                "(inputs, starting state, gradients) have the recorded fingerprints.")
    else:
        first = record["first_difference"]
        text = (f"**Bit for bit:** the rerun differs from the recorded step in {record['differences']} of "
                f"{record['compared']} tensors; first `{first['name']}` ({first['detail']}).")
        if record["points_at"] == "nondeterministic kernels":
            text += (" A rerun without deterministic algorithms differs from the deterministic ones: the kernels are "
                     "nondeterministic here, which can explain it.")
        elif record["points_at"]:
            text += (f" {record['reruns']} deterministic reruns agree with each other and with a rerun without "
                     "deterministic algorithms, from exact conditions: the kernels' nondeterminism does not explain "
                     "the difference. What remains is code outside the rerun that wrote into these tensors (a hook, "
                     "an in-place edit in the loop), a batch the loop laid out at other addresses (the CPU's math "
                     "library rounds by alignment), or the hardware; the same rerun on another device tells the last "
                     "apart.")
    if record.get("not_judged"):
        text += f" What explains the difference was not judged: {record['not_judged']}."
    if record["left_out"]:
        text += f" Not compared: {'; '.join(record['left_out'])}."
    return text


def batch_cause(replayer: Replayer, op: OpSite | None) -> dict | None:
    """The targets of the failing step's batch that leave its loss nothing to average (NOTE: [no supervised
    tokens] in nanscan/engine/targets.py), micro-batch by micro-batch; the ignore index is torch's default, or the
    loss's own when the first bad op is a negative log-likelihood."""
    batch = replayer.batch
    micro = batch.get(MICRO_BATCHES) if isinstance(batch, dict) else None
    recorded = replayer.bundle.manifest.get("micro_batch")
    parts = [(f"micro-batch {i}", part) for i, part in enumerate(micro)] if isinstance(micro, list) else \
        [("the batch" if recorded is None else f"micro-batch {recorded}", batch)]
    return targets_cause(parts, op.op if op is not None else None)


def localize(bundle: Bundle | str | os.PathLike, entry: str | None = None) -> Localization | None:
    """Only the localization: where the replayed step first went non-finite (None when it stays finite)."""
    return Replayer(bundle, entry).run(StepOptions(deterministic=True), localize=True).localization


def replay_markdown(result: ReplayResult) -> str:
    lines = [result.explanation(), "",
             f"- replayed {len(result.runs)} times from the {result.state} state with `{result.entry}`, "
             "deterministic algorithms on",
             "- runs: " + "; ".join(("finite" if r.finite else "error" if r.error else f"non-finite ({r.category})")
                                     for r in result.runs)]
    first = result.failing_run
    if first is not None:
        exponent = first.grad_max_exponent
        lines.append(f"- loss {fmt_value(first.loss)}, {len(first.nonfinite)} non-finite tensor(s)"
                     + (f", largest gradient exponent 2^{exponent}" if exponent is not None else ""))
    if result.localization is not None:
        lines += ["", *result.localization.markdown_lines()]
    if result.op is not None:
        lines += ["", op_markdown(result.op)]
    if result.update is not None:
        lines += ["", update_markdown(result.update)]
    if result.bitwise is not None:
        lines += ["", bitwise_markdown(result.bitwise)]
    if result.bisect is not None:
        b = result.bisect
        if b.applicable:
            shown = b.sample_ids if b.sample_ids is not None else [f"row {i}" for i in b.indices]
            title = "Smallest failing subset" if b.minimal else "Fewest failing samples found"
            lines += ["", f"**{title}:** {len(b.indices)} of {b.batch_size} samples: "
                          f"{', '.join(f'`{s}`' for s in shown)} (rows {b.indices}; {b.trials} trials)."]
            if b.says_more:
                lines[-1] += f" {b.describe()[0].upper()}{b.describe()[1:]}."
        else:
            lines += ["", f"{b.describe()[0].upper()}{b.describe()[1:]}."]
    for failed in result.phase_errors:
        lines += ["", f"**{failed['phase'].capitalize()} failed** (the results above stand): `{failed['error']}`"]
    if result.notes:
        lines += [""] + [f"- note: {n}" for n in result.notes]
    return "\n".join(lines)


def update_finding(replayer: Replayer, options: StepOptions, failing: StepOutcome) -> dict:
    """What a non-finite update broke (its parameters and state tensors, from the replayed step) and the numeric
    traps of its optimizer's settings against the dtypes (nanscan.runtime.traps NOTE: [update traps]), the lr * grad
    check from the replayed step's gradients."""
    spec, optimizer, _ = replayer.prepare(options)
    params = dict(spec.model.named_parameters())
    absmax = {}
    for stats in failing.gradients or ():
        p = params.get(stats.name.partition(":")[2])
        if p is not None:
            absmax[id(p)] = stats.absmax
    broken = [n for n in failing.nonfinite if is_kind(n, "parameter") or is_kind(n, "optimizer_state")]
    traps = optimizer_traps(optimizer, absmax)
    return {"optimizer": type(optimizer).__name__, "broken": broken[:50], "broken_count": len(broken),
            "traps": [t.to_dict() for t in traps]}


def update_markdown(update: dict) -> str:
    broken = ", ".join(f"`{n}`" for n in update["broken"][:8]) + \
        (f" and {update['broken_count'] - 8} more" if update["broken_count"] > 8 else "")
    lines = [f"**The update ({update['optimizer']}.step()) broke:** {broken}."]
    if update["traps"]:
        lines += ["", "Numeric traps of its settings:"] + [f"- {t['text']}" for t in update["traps"]]
    else:
        lines.append("No known numeric trap of its settings applies: look at the size of the step (learning rate, "
                     "gradient norm).")
    return "\n".join(lines)


def record_replay(result: ReplayResult, bundle: Bundle | None = None) -> bool:
    """Add the replay's finding to the bundle (ledger and INCIDENT.md), once: the same result again changes nothing.
    Returns True when the bundle changed."""
    target = bundle or load_bundle(result.bundle)
    title = f"Replay: {result.headline()}"
    return target.add_finding(REPLAY_FINDING, title, replay_markdown(result), result.to_dict())


def recorded_replay(bundle: Bundle) -> dict | None:
    """The record of the bundle's replay finding, if replay has run on it."""
    for finding in bundle.findings():
        if finding.get("key") == REPLAY_FINDING:
            return finding.get("record")
    return None


def suspicious_samples(replayer: Replayer) -> tuple[BisectResult | None, str]:
    """The samples to drop: the smallest failing subset from a recorded replay, else a fresh bisection."""
    recorded = recorded_replay(replayer.bundle)
    bisect = (recorded or {}).get("bisect") or {}
    if bisect.get("applicable") and recorded.get("entry") == replayer.entry:
        return BisectResult(True, list(bisect["indices"]), bisect.get("sample_ids"), bisect.get("batch_size")), \
            "from the recorded replay's bisection"
    return bisect_samples(replayer), "from a bisection of the batch"
