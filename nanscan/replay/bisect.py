"""Bisection of a failing batch to the fewest samples that still fail (ddmin over sample rows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from nanscan.replay.replayer import Replayer
from nanscan.replay.step import StepOptions, sample_ids_of

MAX_BISECT_TRIALS = 64


NOT_SAMPLE_SPECIFIC = "not sample-specific"


@dataclass
class BisectResult:
    """The smallest set of sample rows found that still fails, or why the batch could not be bisected.

    NOTE: [honest bisection]
    A subset is named only when the batch without it was replayed and passed (`rest_passes`): a failure that every
    sample makes on its own (diverged weights, every label masked, a setting) has no culprit, and ddmin, which
    always ends at some subset, would otherwise blame an innocent sample. Such a batch is "not sample-specific"
    (`sample_specific` False, `applicable` False, nothing in `indices`), as is a step whose weights or optimizer
    state were non-finite before it ran.

    minimal: the step was replayed without each one of them in turn and was finite every time (1-minimal), or,
    with `alone`, each of them fails on its own and every other sample was tried alone and passed. False when that
    was not shown: the trial budget ran out, the rest of the batch still fails, or some smaller subsets raised an
    error instead of running (`errors`; a batch of one sample in BatchNorm, a step that needs a fixed batch size).
    """

    applicable: bool
    indices: list[int] = field(default_factory=list)
    sample_ids: list | None = None
    batch_size: int | None = None
    trials: int = 0
    reason: str = ""
    minimal: bool = True
    errors: list[str] = field(default_factory=list)
    sample_specific: bool | None = None  # False: every sample fails (NOTE: [honest bisection]); None: not known
    rest_passes: bool = True  # the batch without `indices` was replayed and finite (or nothing was left)
    alone: bool = False  # each of `indices` fails on its own

    def __post_init__(self):
        if self.sample_specific is None and self.applicable:
            self.sample_specific = True

    @property
    def says_more(self) -> bool:
        """True when describe() qualifies a plain "these samples fail": not minimal, alone, or the whole batch."""
        return self.applicable and (not self.minimal or self.alone or len(self.indices) == self.batch_size)

    def describe(self) -> str:
        """One sentence on how far the bisection got (the samples themselves are shown by the caller)."""
        if not self.applicable:
            return self.reason if self.sample_specific is False else f"bisection not done: {self.reason}"
        if not self.rest_passes:
            return (f"{len(self.indices)} of {self.batch_size} samples fail, but the batch without them fails too: "
                    f"other samples fail as well, so these are not shown to be the cause ({self.trials} trials)")
        if self.alone and self.minimal:
            return (f"each of these {len(self.indices)} of {self.batch_size} samples fails on its own, every other "
                    f"sample passes, and without them the step is finite ({self.trials} trials)")
        if self.minimal and len(self.indices) == self.batch_size:
            return (f"no smaller subset fails: the failure needs all {self.batch_size} samples together (a batch "
                    f"statistic, such as BatchNorm's or a sum over the batch), not particular ones ({self.trials} "
                    "trials)")
        if self.minimal:
            return (f"{len(self.indices)} of {self.batch_size} samples fail together; without any one of them the "
                    f"step is finite ({self.trials} trials)")
        why = (f"subsets of them raised an error instead of running ({self.errors[0]})" if self.errors
               else "the trial budget ran out before every smaller subset was tried")
        return (f"{len(self.indices)} of {self.batch_size} samples still fail; not shown to be the fewest: {why} "
                f"({self.trials} trials)")

    def to_dict(self) -> dict:
        return {"applicable": self.applicable, "indices": list(self.indices), "sample_ids": self.sample_ids,
                "batch_size": self.batch_size, "trials": self.trials, "reason": self.reason,
                "minimal": self.minimal, "errors": list(self.errors), "sample_specific": self.sample_specific,
                "rest_passes": self.rest_passes, "alone": self.alone, "verdict": self.describe()}


def ddmin(items: Sequence[int], fails: Callable[[list[int]], bool], *, max_trials: int = MAX_BISECT_TRIALS,
          tested: dict[frozenset, bool] | None = None) -> tuple[list[int], int]:
    """Delta debugging (Zeller's ddmin): a 1-minimal failing subset of `items`, which must fail as a whole.

    Starts by halving (one failing sample in 16 takes about 8 trials); when no half fails alone, tests finer
    chunks and their complements, which finds failures that need several samples together.
    Returns (subset, trials used); stops early with the smallest set so far after max_trials. `tested`, when
    given, receives every subset tried and whether it failed (a subset missing from it was never tried).
    """
    cache: dict[frozenset, bool] = {} if tested is None else tested
    trials = 0

    def test(subset: list[int]) -> bool:
        nonlocal trials
        key = frozenset(subset)
        if key not in cache:
            if trials >= max_trials:
                return False
            trials += 1
            cache[key] = fails(subset)
        return cache[key]

    current, n = list(items), 2
    while len(current) >= 2:
        size = len(current)
        bounds = [round(i * size / n) for i in range(n + 1)]
        chunks = [current[bounds[i]:bounds[i + 1]] for i in range(n) if bounds[i] < bounds[i + 1]]
        reduced = False
        for chunk in chunks:
            if test(chunk):
                current, n, reduced = chunk, 2, True
                break
        if not reduced and n > 2:
            for chunk in chunks:
                complement = [x for x in current if x not in chunk]
                if test(complement):
                    current, n, reduced = complement, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= size or trials >= max_trials:
                break
            n = min(size, 2 * n)
    return current, trials


def bisect_samples(replayer: Replayer, options: StepOptions = StepOptions(deterministic=True), *,
                   max_trials: int = MAX_BISECT_TRIALS) -> BisectResult:
    """The fewest samples of the saved batch on which the replayed step is still non-finite, named only when the
    batch without them is shown to pass (NOTE: [honest bisection]).

    A subset on which the step raises an error (BatchNorm given one sample, a step that needs a fixed batch size)
    has not been shown to fail: it counts as not failing, and the result says it is not shown to be minimal.
    """
    size = replayer.sample_count
    if size is None:
        return BisectResult(False, reason="the batch has no tensor with a sample dimension")
    if size < 2:
        return BisectResult(False, batch_size=size, reason="the batch has fewer than 2 samples")
    everything = list(range(size))
    whole = replayer.run(options, samples=everything)
    if whole.error is not None:
        return BisectResult(False, batch_size=size, trials=1, reason=f"the replayed step raised an error "
                                                                     f"({whole.error})", errors=[whole.error])
    if whole.finite:
        return BisectResult(False, batch_size=size, trials=1,
                            reason="the step is finite when replayed, so there is nothing to narrow down")
    if whole.start_nonfinite:
        return BisectResult(False, batch_size=size, trials=1, sample_specific=False,
                            reason=f"{NOT_SAMPLE_SPECIFIC}: the weights or optimizer state were already non-finite "
                                   "when the step started, so every subset of the batch fails")
    errors: dict[str, None] = {}
    errored: set[frozenset] = set()

    def fails(subset: list[int]) -> bool:
        outcome = replayer.run(options, samples=subset)
        if outcome.error is not None:
            errors[outcome.error] = None
            errored.add(frozenset(subset))
            return False
        return not outcome.finite

    tested: dict[frozenset, bool] = {}
    indices, _ = ddmin(everything, fails, max_trials=max_trials, tested=tested)
    culprits = set(indices)
    kept = frozenset(indices)
    # 1-minimal only when the step ran, and was finite, without each one of them in turn
    without_one = [kept - {i} for i in kept] if len(kept) > 1 else []
    minimal = all(key in tested and key not in errored for key in without_one)
    rest = [i for i in everything if i not in culprits]
    rest_passes = not rest or not _tried(rest, fails, tested)
    alone = False
    if not rest_passes:
        # NOTE: [honest bisection] the batch fails without them too: other samples fail as well. Each one is tried
        # alone; those that fail alone are culprits in their own right, and when all of them do, none is singled out.
        singles = {}
        for i in everything:
            if len(singles) >= max_trials:
                break
            singles[i] = _tried([i], fails, tested)
        failing = [i for i, failed in singles.items() if failed]
        if len(failing) == len(singles):
            shown = "every sample fails" if len(singles) == size else \
                f"each of the {len(singles)} samples tried fails (of {size})"
            return BisectResult(False, batch_size=size, trials=len(tested) + 1, sample_specific=False,
                                reason=f"{NOT_SAMPLE_SPECIFIC}: {shown} on its own, so no sample is to blame "
                                       "(diverged weights, a setting or a batch-wide fault)",
                                errors=list(errors)[:3])
        culprits = set(failing)
        rest = [i for i in everything if i not in culprits]
        if not culprits or (rest and _tried(rest, fails, tested)):
            alone = f"rows {sorted(culprits)} fail on their own, " if culprits else "no sample fails on its own, "
            return BisectResult(False, batch_size=size, trials=len(tested) + 1, sample_specific=False,
                                reason=f"{NOT_SAMPLE_SPECIFIC}: {alone}and the batch without them fails too, so the "
                                       "failure is not specific to some samples (the weights, a setting, or a "
                                       "statistic of the whole batch)", errors=list(errors)[:3])
        alone, rest_passes = True, True
        minimal = len(singles) == size
    ids = sample_ids_of(replayer.bundle.sample_ids, sorted(culprits), size)
    return BisectResult(True, sorted(culprits), ids, size, len(tested) + 1, minimal=minimal and rest_passes,
                        errors=list(errors)[:3], rest_passes=rest_passes, alone=alone)


def _tried(subset: list[int], fails: Callable[[list[int]], bool], tested: dict[frozenset, bool]) -> bool:
    """Whether `subset` fails, from `tested` when it was tried already (and recorded there when it was not)."""
    key = frozenset(subset)
    if key not in tested:
        tested[key] = fails(subset)
    return tested[key]
