"""`nanscan ablate BUNDLE` over the window: one factor at a time through the replay entry, on its held-out batches,
with the failing batch's suspicious samples from a bisection (nanscan.runtime.window_ablation NOTE: [window
ablation], which the Monitor's in-process diagnosis shares), and the table it prints."""

from __future__ import annotations

import itertools
import os
from typing import Callable

from nanscan.bundle import Bundle
from nanscan.replay.replayer import Replayer, open_bundle
from nanscan.replay.reproduce import suspicious_samples
# re-exported: the tools' names
from nanscan.runtime.window_ablation import (CONFIRMED, DEFAULT_BEYOND, DELAYS, EARLIER, NO_EFFECT,  # noqa: F401
                                             NOT_APPLIED, NOT_JUDGED, NOT_RECOVERED, UNCONFIRMED, WindowAblation,
                                             WindowRow, ablate_over_window, conclusion, horizon,
                                             loss_before_divergence, lr_summary, record_window_ablation)


def ablate_window(bundle: Bundle | str | os.PathLike, entry: str | None = None, *, beyond: int = DEFAULT_BEYOND,
                  trust_bundle_paths: bool = False,
                  progress: Callable[[str], None] | None = None) -> WindowAblation:
    """Rerun the window as recorded, then once per factor (NOTE: [window ablation]), through the replay entry
    chosen as for `nanscan replay` (NOTE: [trust rule] in nanscan/entry.py); nothing is written (see
    record_window_ablation)."""
    replayer = Replayer(open_bundle(bundle), entry, trust_bundle_paths=trust_bundle_paths)
    spec = replayer.build()
    held_out = list(itertools.islice(spec.batches, beyond)) if spec.batches is not None and beyond > 0 else []
    return ablate_over_window(replayer, spec, held_out, beyond=beyond, suspicious=lambda: suspicious_samples(replayer),
                              progress=progress)


def print_window_ablation(result: WindowAblation, console) -> None:
    from rich.markup import escape  # noqa: PLC0415 - paths and labels are not markup
    from rich.table import Table  # noqa: PLC0415

    console.print(f"[bold]{escape(result.bundle)}[/bold] (step {result.step}): {escape(result.baseline.detail)}")
    table = Table(title="one factor at a time over the window (rows that do not fix it are evidence too)")
    for column in ("factor", "verdict", "detail"):
        table.add_column(column, overflow="fold")
    colors = {CONFIRMED: "green", NO_EFFECT: "red", EARLIER: "red", DELAYS: "yellow"}
    for row in result.rows:
        color = colors.get(row.verdict, "white")
        table.add_row(escape(row.factor.label), f"[{color}]{escape(row.verdict)}[/{color}]", escape(row.detail))
    console.print(table)
    console.print(conclusion(result), highlight=False, markup=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
