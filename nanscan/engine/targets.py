"""Targets that leave a loss no token to learn from (NOTE: [no supervised tokens]): the rule `nanscan data` applies to
a record's labels, and that the incident note and replay apply to the integer tensors of a failing step's batch.

It lives with the engine, below every layer that applies it (the data check and replay are tools, the incident
note is evidence), so that all of them judge a batch by the same rule and name it in the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# NOTE: [no supervised tokens]
# A record whose labels are all the ignore index (-100 for torch's cross_entropy and every Hugging Face model), or
# whose loss mask is 0 everywhere, gives the loss no token to learn from: a mean cross-entropy over it is 0/0 = NaN
# (PyTorch returns NaN when every target is ignored), and a summed loss divided by its count of supervised tokens
# divides by 0. It happens when truncation cuts away the whole answer of a prompt whose tokens are masked, or when a
# template puts no supervised token in. `nanscan data` reports one finding per such field of a record. At an
# incident the same rule names the cause of a step whose loss (or, with no loss checked, gradients) went
# non-finite: an integer tensor of the batch whose every value is the ignore index. The Monitor's note knows only
# the default ignore index; replay also knows the loss's own (nanoGPT's ignore_index=-1) when the first bad op it
# finds is the negative log-likelihood, which raises on a negative target unless it is the ignore index, so a
# target tensor that holds one negative value throughout holds the loss's ignore index.
DEFAULT_IGNORE_INDEX = -100
# The aten ops of a negative log-likelihood (cross_entropy calls them), as replay's op localization names them.
NLL_OPS = ("aten.nll_loss_forward", "aten.nll_loss2d_forward", "aten.nll_loss", "aten.nll_loss_nd",
           "aten.cross_entropy_loss")


def all_ignored(values: Any, ignore_index: int) -> bool:
    """Whether `values` (labels: a tensor, an array or a list of numbers) hold at least one value and every one is
    `ignore_index`."""
    if not hasattr(values, "numel"):  # a torch tensor is compared where it lies; anything else as an array
        values = np.asarray(values)
    size = values.numel() if hasattr(values, "numel") else values.size
    return size > 0 and bool((values == ignore_index).all())


@dataclass(frozen=True)
class IgnoredTargets:
    """An integer tensor of a batch whose every value is the loss's ignore index (NOTE: [no supervised tokens])."""

    path: str  # where it is in the batch (nanscan.engine.inputs.iter_batch_tensors: "labels", "1")
    count: int
    ignore_index: int

    def describe(self, scope: str = "the batch") -> str:
        """The cause in words; `scope` names the batch ("micro-batch 0")."""
        return (f"every target of {scope} (`{self.path}`, {self.count} value(s)) is {self.ignore_index}, the ignore "
                "index: a mean cross-entropy over no tokens is 0/0")

    def to_dict(self) -> dict:
        return {"path": self.path, "count": self.count, "ignore_index": self.ignore_index}

    def cause(self, scope: str) -> dict:
        """The cause as an incident's finding records it: the text, a short form, the scope and the tensor."""
        return {"text": self.describe(scope), "short": f"every target of {scope} is {self.ignore_index}, the "
                                                       "ignore index", "scope": scope, **self.to_dict()}


def targets_cause(parts: list[tuple[str, Any]], op: str | None = None) -> dict | None:
    """The cause record (IgnoredTargets.cause) of the first of `parts` ((scope, batch): "micro-batch 0", its batch)
    whose targets are all ignored, or None; the ignore index is torch's default, or the loss's own when the first
    bad op `op` is a negative log-likelihood (NOTE: [no supervised tokens]). Replay and the in-process rerun ask."""
    loss_ignores = op in NLL_OPS
    for scope, part in parts:
        found = ignored_targets(part, None) if loss_ignores else ignored_targets(part)
        if found:
            return found[0].cause(scope)
    return None


def ignored_targets(batch: Any, ignore_index: int | None = DEFAULT_IGNORE_INDEX) -> list[IgnoredTargets]:
    """The integer tensors of `batch` whose every value is `ignore_index` (NOTE: [no supervised tokens]). None: the
    loss is known to be a negative log-likelihood, and a tensor holding one negative value throughout holds its
    ignore index, whatever it is (-1, -100)."""
    # `nanscan data --help` reads DEFAULT_IGNORE_INDEX from here without torch (NOTE: [fast help] in
    # nanscan/cli/main.py); a batch of tensors means torch is loaded already.
    import torch  # noqa: PLC0415

    from nanscan.engine.inputs import iter_batch_tensors  # noqa: PLC0415

    found = []
    for path, t in iter_batch_tensors(batch):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or not t.numel():
            continue
        if ignore_index is None:
            low = int(t.min())
            if low < 0 and all_ignored(t, low):
                found.append(IgnoredTargets(path, t.numel(), low))
        elif all_ignored(t, ignore_index):
            found.append(IgnoredTargets(path, t.numel(), ignore_index))
    return found


def ignored_rows(batch: Any, size: int, ignore_index: int = DEFAULT_IGNORE_INDEX) -> list[int]:
    """The rows (the leading index, `size` of them) of a batch whose every target in some integer tensor is the
    ignore index (NOTE: [no supervised tokens]): records that leave a per-record mean loss 0/0, which a rollback
    quarantines like a NaN row."""
    import torch  # noqa: PLC0415 - NOTE: [fast help], as above

    from nanscan.engine.inputs import rows_where  # noqa: PLC0415

    def targets(t: torch.Tensor) -> bool:  # the integer tensors of a row each: token labels
        return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool) and t.dim() >= 2

    return rows_where(batch, size, targets, lambda rows: (rows == ignore_index).all(dim=1))


def breaking_rows(batch: Any, size: int) -> list[int]:
    """The records that break a step by themselves, by one rule for each reader (a rollback quarantines them, the
    in-process diagnosis drops them): the rows holding a NaN, an infinity or an overflow value (engine.inputs.bad_rows),
    and those whose targets are all the ignore index (ignored_rows, NOTE: [no supervised tokens]: a per-record mean
    loss over them is 0/0)."""
    from nanscan.engine.inputs import bad_rows  # noqa: PLC0415 - as ignored_rows

    return sorted(set(bad_rows(batch, size)) | set(ignored_rows(batch, size)))
