"""The README's quickstart runs as it is: its plain loop (accumulation with observe(), bf16 autocast, a disabled
GradScaler, clipping after the check) stops at the NaN record it plants, at its step and micro-batch, with a
bundle that says so and names the disabled scaler."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from nanscan import load_bundle

README = Path(__file__).resolve().parent.parent / "README.md"


def quickstart_blocks() -> list[str]:
    return re.findall(r"```python\n(# quickstart\n.*?)```", README.read_text(), re.S)


def test_the_readme_quickstart_runs_and_stops_at_its_planted_nan(tmp_path, monkeypatch):
    blocks = quickstart_blocks()
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(README) + ":quickstart", "exec"), {"__name__": "__quickstart__"})
    path = Path(out.getvalue().strip())
    assert path == tmp_path / "bundles/quickstart/step-5"
    bundle = load_bundle(path)
    assert (bundle.step, bundle.micro_batch) == (5, 2)
    assert bool(bundle.batch(nested=True)["x"][3, 0].isnan())
    text = bundle.incident_text()
    assert "GradScaler: given, but disabled" in text and "handed over by observe()" in text
    # the commands the README shows next name this bundle
    assert "nanscan report bundles/quickstart/step-5" in README.read_text()
