"""Bisection of a failing batch to the fewest samples that still fail (ddmin over sample rows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from nanscan.replay.replayer import Replayer
from nanscan.replay.step import StepOptions, sample_ids_of

MAX_BISECT_TRIALS = 64


@dataclass
class BisectResult:
    """The smallest set of sample rows found that still fails, or why the batch could not be bisected.

    minimal: the step was replayed without each one of them in turn and was finite every time (1-minimal). False
    when that was not shown: the trial budget ran out, or some of those smaller subsets raised an error instead
    of running (`errors`; a batch of one sample in BatchNorm, a step that needs a fixed batch size).
    """

    applicable: bool
    indices: list[int] = field(default_factory=list)
    sample_ids: list | None = None
    batch_size: int | None = None
    trials: int = 0
    reason: str = ""
    minimal: bool = True
    errors: list[str] = field(default_factory=list)

    @property
    def says_more(self) -> bool:
        """True when describe() qualifies a plain "these samples fail": not minimal, or the whole batch."""
        return self.applicable and (not self.minimal or len(self.indices) == self.batch_size)

    def describe(self) -> str:
        """One sentence on how far the bisection got (the samples themselves are shown by the caller)."""
        if not self.applicable:
            return f"bisection not done: {self.reason}"
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
                "minimal": self.minimal, "errors": list(self.errors)}


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
    """The fewest samples of the saved batch on which the replayed step is still non-finite.

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
    indices, trials = ddmin(everything, fails, max_trials=max_trials, tested=tested)
    kept = frozenset(indices)
    # 1-minimal only when the step ran, and was finite, without each one of them in turn
    without_one = [kept - {i} for i in kept] if len(kept) > 1 else []
    minimal = all(key in tested and key not in errored for key in without_one)
    ids = sample_ids_of(replayer.bundle.sample_ids, indices, size)
    return BisectResult(True, sorted(indices), ids, size, trials + 1, minimal=minimal,
                        errors=list(errors)[:3])
