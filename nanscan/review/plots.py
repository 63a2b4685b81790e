"""The plots of `nanscan report --html`, drawn with matplotlib from the summary (nanscan.review.summary) and the
bundle's history: loss and gradient norm, the divergence before the incident, the exponent histograms over the
history, the non-finite map by module. Steps a rollback abandoned are shaded on every plot over the steps, in one
colour per rollback (a band above each heatmap, whose cells stay as the data colours them), their points hollow on
the loss and gradient-norm curves. matplotlib is imported when a plot is drawn, not before.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np

from nanscan.engine import _layout as L
from nanscan.review.summary import KIND_LABEL, abandoned_steps, is_finite, json_float, kind_rank, split_name
from nanscan.review.text import abandoned_label, headline, pct

HEATMAP_TENSORS = 6
HEATMAP_MAX_ROWS = 48  # binade rows drawn as one contiguous range
MAP_MAX_ROWS = 40  # beyond this many modules the non-finite map is drawn per layer
# the colours of the run's rollbacks on every plot: one each, in the order they happened (then again from the first)
ABANDONED_COLORS = ("purple", "teal", "saddlebrown", "olive")
STRIP_HEIGHT = 1.05  # a heatmap's abandoned steps: a band from its top to this fraction of its height


def rollback_colours(spans: list[dict]) -> dict[int, str]:
    """Each rollback's colour by its step (summary["abandoned"]'s at_step), in the order they happened: every plot
    gives a rollback the same one, and two rollbacks' spans side by side stay told apart."""
    colours: dict[int, str] = {}
    for span in spans:
        colours.setdefault(span["at_step"], ABANDONED_COLORS[len(colours) % len(ABANDONED_COLORS)])
    return colours


def _figure(width: float, height: float):
    # A bare Figure with its own Agg canvas: no pyplot global state, no GUI backend, safe in any process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_base64(fig) -> str:
    """The figure as a PNG, base64 for a data: URL (no date or software in it: the same report, the same bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _shade_abandoned(ax, spans: list[dict], positions: list[tuple[int, float]], *, strip: bool = False) -> bool:
    """Shade each run of abandoned steps (summary["abandoned"]) among the plotted ones, `positions` their (step, x),
    in its rollback's colour (rollback_colours); one legend entry per rollback. `strip`: a band just above the axes
    instead of a wash over their whole height (a heatmap, whose every cell's colour is data). Whether any was
    shaded."""
    colours = rollback_colours(spans)
    labelled = set()
    for span in spans:
        xs = [x for s, x in positions if span["first"] <= s <= span["last"]]
        if not xs:
            continue
        at = span["at_step"]
        band = {"ymin": 1.0, "ymax": STRIP_HEIGHT, "alpha": 0.7, "clip_on": False} if strip else \
            {"alpha": 0.12, "zorder": 0}
        ax.axvspan(min(xs) - 0.5, max(xs) + 0.5, color=colours[at], lw=0,
                   label=None if at in labelled else abandoned_label(at), **band)
        labelled.add(at)
    return bool(labelled)


def _plot_points(ax, good: list[tuple[int, float]], abandoned: dict[int, int], colours: dict[int, str],
                 **line) -> None:
    """Finite (step, value) points as a line through the steps the run went on with; those a rollback abandoned
    (`abandoned`: their steps, each with the rollback's step, abandoned_steps) as hollow markers off it in that
    rollback's colour, since the next step after them started from an earlier state."""
    kept = [(s, v) for s, v in good if s not in abandoned]
    if kept:
        ax.plot(*zip(*kept), marker=".", lw=1.2, **line)
    for at, colour in colours.items():
        undone = [(s, v) for s, v in good if abandoned.get(s) == at]
        if undone:
            ax.plot(*zip(*undone), ls="none", marker="o", ms=5, mfc="none", mec=colour, zorder=3)


def _legend(ax, *, above: bool = False) -> None:
    """The axes' legend, if it has entries: inside its upper left corner, or `above` it at the right (a heatmap,
    whose every cell is data a legend would cover)."""
    if not ax.get_legend_handles_labels()[0]:
        return
    if above:
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, STRIP_HEIGHT), ncol=3, fontsize=7, frameon=False)
    else:
        ax.legend(loc="upper left", fontsize=8, framealpha=0.8)


def _heatmap_tensors(summary: dict, history) -> list[str]:
    """The tensors worth a heatmap: for a `loss` failure the (finite) batch tensors first, since the data fed to
    the forward pass is the first suspect; then the non-finite tensors, the category's own kind first; then the
    tensors whose largest value jumped most at the failing step."""
    first_kind = summary["category"]
    names = [t["name"] for t in sorted(summary["nonfinite_tensors"],
                                       key=lambda t: (t["kind"] != first_kind, kind_rank(t["kind"])))]
    if summary["category"] == "loss":
        names = [r["name"] for r in summary["inputs_at_failure"]] + names
    names += [j["name"] for j in summary["exponent_jumps"]]
    present = {name for entry in history for name in entry.report.names}
    return [n for n in dict.fromkeys(names) if n in present][:HEATMAP_TENSORS]


def _binade_rows(occupied: np.ndarray) -> np.ndarray:
    """Histogram bins to draw as rows: the occupied range plus a margin when it is compact; otherwise only the
    occupied bins, so a few values far from the rest (a 2**127 among ones) still get a visible row."""
    if not len(occupied):
        return np.arange(L.HIST_BINS // 2 - 4, L.HIST_BINS // 2 + 4)
    lo, hi = max(occupied[0] - 2, 0), min(occupied[-1] + 2, L.HIST_BINS - 1)
    if hi - lo + 1 <= HEATMAP_MAX_ROWS:
        return np.arange(lo, hi + 1)
    return occupied


def plot_exponent_heatmap(summary: dict, history):
    """Exponent histogram of each chosen tensor over the history steps (colour: fraction of the tensor's elements
    in each binade); a red X marks steps where the tensor held NaN/inf, dashed lines mark skipped binades, a shade
    the steps a rollback abandoned."""
    from matplotlib.colors import LogNorm

    names = _heatmap_tensors(summary, history)
    if not names or not history:
        return None
    steps = [e.step for e in history]
    fig = _figure(10, 2.1 * len(names) + 0.6)
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names):
        fractions = np.full((L.HIST_BINS, len(steps)), np.nan)
        bad_steps = []
        for j, entry in enumerate(history):
            if name in entry.report:
                stats = entry.report[name]
                column = stats.exp_hist / max(stats.numel, 1)
                fractions[:, j] = np.where(column > 0, column, np.nan)
                if stats.nonfinite:
                    bad_steps.append(j)
        rows = _binade_rows(np.flatnonzero(np.isfinite(fractions).any(axis=1)))
        image = ax.imshow(fractions[rows], origin="lower", aspect="auto", cmap="viridis",
                          norm=LogNorm(vmin=1e-4, vmax=1.0), interpolation="nearest",
                          extent=(-0.5, len(steps) - 0.5, -0.5, len(rows) - 0.5))
        for i in np.flatnonzero(np.diff(rows) > 1):  # binades skipped between two drawn rows
            ax.axhline(i + 0.5, color="0.3", lw=1, ls=(0, (4, 3)))
        every = max(1, len(rows) // 8)
        ax.set_yticks(range(0, len(rows), every), [str(b + L.MIN_BIN_EXPONENT) for b in rows[::every]],
                      fontsize=7)
        if bad_steps:
            ax.scatter(bad_steps, [len(rows) - 1] * len(bad_steps), marker="X", s=60, color="red", zorder=3,
                       label="NaN/inf present")
        _shade_abandoned(ax, summary.get("abandoned") or [], [(s, j) for j, s in enumerate(steps)], strip=True)
        _legend(ax, above=True)
        ax.set_title(name, fontsize=9, loc="left", parse_math=False, pad=10)  # a '$' in a batch key is not TeX
        ax.set_ylabel("log2 |x|", fontsize=8)
        fig.colorbar(image, ax=ax, pad=0.01, label="fraction")
    every = max(1, len(steps) // 12)
    ticks = sorted(set(range(0, len(steps), every)[:-1]) | {len(steps) - 1})  # always label the last step
    axes[-1].set_xticks(ticks, [str(steps[i]) for i in ticks])
    axes[-1].set_xlabel("step")
    fig.suptitle("exponent histogram per step (finite values)", fontsize=10)
    return fig


def _mark_nonfinite(ax, step: int, text: str | None = None) -> None:
    """A non-finite value at `step`: a red X at the top of the axis (a log axis has no place for it), labelled with
    what it was when `text` is given."""
    ax.scatter([step], [1.0], transform=ax.get_xaxis_transform(), marker="X", s=70, color="red", zorder=3,
               clip_on=False)
    if text is not None:
        ax.annotate(text, xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(-8, -4),
                    textcoords="offset points", ha="right", va="top", color="red", fontsize=9)


def plot_curves(summary: dict, history):
    """Loss and gradient norm over the history, with the first invalid step marked; a non-finite value is drawn
    as a red X at the top of the axis, labelled with what it was; the run's rollbacks as purple dotted lines, the
    steps each abandoned shaded and their points hollow, off the line that the run went on with."""
    if not history:
        return None
    step = summary["first_invalid_step"]
    abandoned = abandoned_steps(summary.get("abandoned"))
    colours = rollback_colours(summary.get("abandoned") or [])
    positions = [(e.step, e.step) for e in history]
    fig = _figure(10, 4.6)
    ax_loss, ax_norm = fig.subplots(2, 1, sharex=True)
    for ax, key, label in ((ax_loss, "loss", "loss"), (ax_norm, "grad_norm", "grad norm (finite values)")):
        points = [(e.step, getattr(e, key)) for e in history if getattr(e, key) is not None]
        good = [(s, v) for s, v in points if math.isfinite(v)]
        _plot_points(ax, good, abandoned, colours, color="tab:blue")
        if key == "grad_norm" and good and min(v for _s, v in good) > 0:
            ax.set_yscale("log")
        if step is not None:
            ax.axvline(step, color="red", ls="--", lw=1)
        spiked = {s["step"] for s in summary.get("spikes", [])}
        marked = [(s, v) for s, v in good if s in spiked]
        if marked:
            ax.scatter(*zip(*marked), marker="^", s=60, color="darkorange", zorder=3, label="spike")
        for s, v in points:
            if not math.isfinite(v):
                _mark_nonfinite(ax, s, json_float(v))
        shown = [r for r in summary.get("rollbacks", []) if "at_step" in r and points
                 and points[0][0] <= r["at_step"] <= points[-1][0]]
        for r in shown:  # the Monitor went back to an earlier state here (on_invalid=Rollback)
            colour = colours.get(r["at_step"], ABANDONED_COLORS[0])
            ax.axvline(r["at_step"], color=colour, ls=":", lw=1.5)
            if key == "loss":
                # below the top, where a non-finite value at the same step has its label
                ax.annotate(f"rollback to step {r['restored_step']}", xy=(r["at_step"], 0.8),
                            xycoords=("data", "axes fraction"), xytext=(-4, 0), textcoords="offset points",
                            ha="right", color=colour, fontsize=8)
        _shade_abandoned(ax, summary.get("abandoned") or [], positions)
        _legend(ax)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if step is not None:
        ax_norm.annotate(headline(summary), xy=(step, 0.5), xycoords=("data", "axes fraction"),
                         xytext=(-6, 0), textcoords="offset points", ha="right", va="center", color="red",
                         fontsize=9)
    ax_norm.set_xlabel("step")
    return fig


def plot_divergence(div: dict, abandoned: list[dict] = ()):
    """The steps before the incident on log axes: loss, gradient norm, each param group's learning rate and the
    loss scale; a dotted line where layers began to grow (NOTE: [divergence onset]), labelled with them, a dashed
    red one at the incident; a non-finite value is a red X at the top of its axis; `abandoned`
    (summary["abandoned"]): the steps rollbacks abandoned, shaded."""
    from nanscan.bundle.divergence import onsets_by_step  # noqa: PLC0415 - NOTE: [fast help]

    rows = div["steps"]
    abandoned_at = abandoned_steps(abandoned)
    colours = rollback_colours(list(abandoned))
    fig = _figure(10, 6.4)
    ax_loss, ax_norm, ax_lr = fig.subplots(3, 1, sharex=True)
    series = [(ax_loss, "loss", [(r["step"], r["loss"]) for r in rows], "tab:blue"),
              (ax_norm, "grad norm", [(r["step"], "nan" if r["nonfinite_gradients"] else r["grad_norm"])
                                      for r in rows], "tab:purple")]
    groups = max((len(r["lrs"]) for r in rows), default=0)
    differ = any(len(set(map(str, r["lrs"]))) > 1 for r in rows)
    for g in range(groups if differ else min(groups, 1)):
        series.append((ax_lr, f"lr, group {g}" if differ else "learning rate",
                       [(r["step"], r["lrs"][g]) for r in rows if len(r["lrs"]) > g], None))
    for ax, label, points, color in series:
        values = [(s, None if v is None else float(v)) for s, v in points]
        good = [(s, v) for s, v in values if v is not None and math.isfinite(v)]
        _plot_points(ax, good, abandoned_at, colours, color=color, label=label)
        if good and min(v for _s, v in good) > 0:
            ax.set_yscale("log")
        for s, v in values:
            if v is not None and not math.isfinite(v):
                _mark_nonfinite(ax, s)
        ax.set_ylabel(label if ax is not ax_lr else "learning rate")
    scales = [(r["step"], float(r["loss_scale"])) for r in rows if is_finite(r["loss_scale"])]
    if scales:
        ax_scale = ax_lr.twinx()
        ax_scale.step(*zip(*scales), where="post", color="tab:green", lw=1.2, label="loss scale")
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_ylabel("loss scale", color="tab:green")
    if differ:
        ax_lr.legend(loc="upper left", fontsize=8, framealpha=0.8)
    onsets = onsets_by_step(div)
    for ax in (ax_loss, ax_norm, ax_lr):
        ax.grid(alpha=0.3)
        ax.axvline(div["step"], color="red", ls="--", lw=1)
        for onset in onsets:
            ax.axvline(onset, color="darkorange", ls=":", lw=1.5)
        shaded = _shade_abandoned(ax, list(abandoned), [(r["step"], r["step"]) for r in rows])
    if shaded:
        _legend(ax_loss)
    for onset, layers in onsets.items():
        text = ", ".join(layers[:2]) + (f" +{len(layers) - 2}" if len(layers) > 2 else "")
        ax_loss.annotate(f"{text} from {onset}", xy=(onset, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(3, 3), textcoords="offset points", ha="left", va="bottom", color="darkorange",
                         fontsize=8, annotation_clip=False)
    ax_norm.annotate(f"incident {div['step']}", xy=(div["step"], 0.5), xycoords=("data", "axes fraction"),
                     xytext=(-6, 0), textcoords="offset points", ha="right", va="center", color="red", fontsize=9)
    ax_lr.set_xlabel("step")
    return fig


def _map_cells(summary: dict, history) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """Rows (modules, or layers when there are many), kind columns, non-finite fraction and count per cell."""
    step = summary["first_invalid_step"]
    failing = next((e for e in history if e.step == step), None)
    reference = failing or (history[-1] if history else None)
    tensors: list[tuple[str, str, str, int, int]] = []  # kind, module, layer, numel, nonfinite
    if failing is not None:
        for s in failing.report:
            tensors.append((*split_name(s.name), s.numel, s.nonfinite))
    else:
        bad = {t["name"]: t for t in summary["nonfinite_tensors"]}
        for s in (reference.report if reference else []):
            t = bad.get(s.name)
            tensors.append((*split_name(s.name), s.numel, t["nan"] + t["posinf"] + t["neginf"] if t else 0))
    use_layers = len({m for _k, m, *_ in tensors}) > MAP_MAX_ROWS
    rows = list(dict.fromkeys((layer if use_layers else module) for _k, module, layer, *_ in tensors))
    kinds = sorted({k for k, *_ in tensors}, key=kind_rank)
    numel = np.zeros((len(rows), len(kinds)))
    bad = np.zeros((len(rows), len(kinds)))
    for kind, module, layer, n, nonfinite in tensors:
        i, j = rows.index(layer if use_layers else module), kinds.index(kind)
        numel[i, j] += n
        bad[i, j] += nonfinite
    fraction = np.where(numel > 0, bad / np.maximum(numel, 1), np.nan)
    return rows, kinds, fraction, bad


def plot_nonfinite_map(summary: dict, history):
    """Which modules held NaN/inf at the failing step, per kind of tensor (fraction of elements)."""
    rows, kinds, fraction, bad = _map_cells(summary, history)
    if not rows:
        return None
    fig = _figure(2.2 + 1.3 * len(kinds), 0.8 + 0.32 * len(rows))
    ax = fig.subplots()
    cmap = _nonfinite_cmap()
    image = ax.imshow(fraction, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for i in range(len(rows)):
        for j in range(len(kinds)):
            if np.isfinite(fraction[i, j]) and bad[i, j]:
                ax.text(j, i, pct(fraction[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if fraction[i, j] > 0.5 else "black")
    ax.set_xticks(range(len(kinds)), [KIND_LABEL.get(k, k) for k in kinds])
    ax.set_yticks(range(len(rows)), rows, fontsize=8, parse_math=False)
    ax.xaxis.tick_top()
    ax.set_title(f"non-finite elements at step {summary['first_invalid_step']} (grey: no such tensor)",
                 fontsize=10)
    fig.colorbar(image, ax=ax, pad=0.02, label="non-finite fraction")
    return fig


def _nonfinite_cmap():
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("nonfinite", ["#f4f4f4", "#fdae61", "#d7191c", "#67000d"])
    return cmap.with_extremes(bad="#bdbdbd")


