"""The README's quickstart runs as it is: its plain loop (accumulation with observe(), bf16 autocast, a disabled
GradScaler, clipping after the check) stops at the NaN record it plants, at its step and micro-batch, with a
bundle that says so and names the disabled scaler. And the README and docs/ stay true: every link reaches its page
and heading, every nanscan name their code imports exists, every command they show is a real subcommand with real
options."""

from __future__ import annotations

import contextlib
import importlib
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


# -- the README and docs/ stay true: links, the names their code imports, the commands they show ------------------

ROOT = README.parent
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), re.S)


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub renders it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_readme_and_docs_reaches_a_file_and_heading():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            found = (page.parent / path).resolve() if path else page
            assert found.is_file(), f"{page.name}: {target} is not a file"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", found.read_text(), re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{page.name}: no heading #{anchor} in {found.name}"
            checked += 1
    assert checked >= 10  # the README's reference list, the docs' way back, the cross-references


def test_every_nanscan_name_the_code_blocks_import_exists():
    names = []
    for page in PAGES:
        for block in _blocks(page, "python"):
            for module, imported in re.findall(r"^\s*from (nanscan[\w.]*) import ([\w, ]+)", block, re.M):
                names += [(page.name, module, name.strip()) for name in imported.split(",")]
        # the quickstart's one-line table: nanscan.integrations.<module>.<name>
        names += [(page.name, *dotted.rsplit(".", 1))
                  for dotted in re.findall(r"`(?:mon = )?(nanscan\.integrations\.\w+\.\w+)\(", page.read_text())]
    assert len(names) >= 8
    for page, module, name in names:
        assert hasattr(importlib.import_module(module), name), f"{page}: {module}.{name} does not exist"


def test_every_command_the_docs_show_is_a_real_subcommand_with_real_options():
    import click
    from nanscan.cli.main import main

    ctx = click.Context(main)
    shown = 0
    for page in PAGES:
        for block in _blocks(page, "bash"):
            for line in block.splitlines():
                words = line.split("#")[0].split()
                if len(words) < 2 or words[0] != "nanscan":
                    continue
                command = main.get_command(ctx, words[1])
                assert command is not None, f"{page.name}: `nanscan {words[1]}` is no subcommand"
                options = {opt for param in command.params for opt in param.opts + param.secondary_opts}
                for word in words[2:]:
                    if word.startswith("--"):
                        assert word.split("=")[0] in options, f"{page.name}: `nanscan {words[1]}` has no {word}"
                shown += 1
    assert shown >= 10
