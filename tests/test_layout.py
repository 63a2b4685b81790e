"""The package's structure holds: no import cycle among nanscan's modules (imports inside functions counted), no
module importing another's private name, every module opening with a purpose line, and the layers, each its
folders, importing one way only (tools -> runtime -> evidence -> engine; ARCHITECTURE.md), with the command line
(nanscan/cli/) on top of the tools."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanscan"

# Each layer may import its own modules and those of the layers after it, never those before it. A layer is its
# folders (and the few public-face modules at the package's top that belong to it).
LAYERS = {
    # the workflow before and after a run, the command line on top of it (test_the_command_line_is_at_the_top)
    "tools": ("cli", "replay", "review", "data", "demo", "preflight", "testing", "bench_scan", "__main__"),
    # the every-step path; integrations: adapters for other frameworks, at the runtime's level, beside the Monitor,
    # which opens the TensorBoard export, and which the trainer adapters drive
    "runtime": ("runtime", "integrations"),
    "evidence": ("bundle", "entry"),
    # incident: the vocabulary every layer shares; scan: the nanscan.scan entry point
    "engine": ("engine", "incident", "scan", "_atomic", "_lazy"),
}
# What the tools' own subcommands (nanscan.replay.cli, report, ...) and the single-module tools share with
# nanscan/cli/: every other module there is the program and its subcommands, which nothing stands on.
CLI_SHARED = ("nanscan.cli", "nanscan.cli.errors", "nanscan.cli.bench_options", "nanscan.cli.preflight_options")
ORDER = list(LAYERS)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


@functools.cache
def _imports(name: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every import in a module, inside functions too."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append((node.lineno, base, [alias.name for alias in node.names]))
    return found


def _resolve(target: str) -> str | None:
    """The nanscan module an import names (the longest known prefix), or None outside the package."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


@functools.cache
def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for _, target, names in _imports(name):
            for candidate in [target] + [f"{target}.{n}" for n in names]:
                resolved = _resolve(candidate)
                # A package re-exporting its own modules is how a package shows its face, not a cycle.
                if resolved and resolved != name and not (_is_package(name) and resolved.startswith(name + ".")):
                    edges[name].add(resolved)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    assert _cycles(_edges()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_name():
    offences = []
    for name in MODULES:
        for line, target, names in _imports(name):
            resolved = _resolve(target)
            if resolved is None:
                continue
            for imported in names:
                is_module = f"{resolved}.{imported}" in MODULES or imported in ("_C", "_torch_access")
                if imported.startswith("_") and not is_module:
                    offences.append(f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} imports {imported} from "
                                    f"{resolved}")
    assert offences == []


def _layer(name: str) -> str:
    top = name.split(".")[1] if name.count(".") else "__init__"
    for layer, tops in LAYERS.items():
        if top in tops:
            return layer
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS in tests/test_layout.py and ARCHITECTURE.md")


def _upward(name: str, edges: dict[str, set[str]]) -> list[str]:
    """What `name` imports from a layer above its own."""
    mine = ORDER.index(_layer(name))
    return sorted(target for target in edges[name] if target != "nanscan" and ORDER.index(_layer(target)) < mine)


@pytest.mark.parametrize("name", [n for n in MODULES if n != "nanscan"])
def test_imports_point_down_the_layers(name):
    assert _upward(name, _edges()) == [], f"{name} ({_layer(name)}) imports from a layer above it"


def test_an_upward_import_is_found():
    edges = {"nanscan.engine.stats": {"nanscan.runtime.monitor", "nanscan.incident"},
             "nanscan.bundle.write": {"nanscan.engine.stats"}}
    assert _upward("nanscan.engine.stats", edges) == ["nanscan.runtime.monitor"]
    assert _upward("nanscan.bundle.write", edges) == []


def test_every_package_folder_belongs_to_a_layer():
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders == {top for tops in LAYERS.values() for top in tops if (PACKAGE / top).is_dir()}


def test_the_command_line_is_at_the_top():
    """Only `python -m nanscan` imports the program (nanscan.cli.main) or a subcommand of nanscan/cli/; the rest of
    the package takes from there only what the subcommands share (CLI_SHARED)."""
    assert set(CLI_SHARED) <= set(MODULES)
    top = {name for name in MODULES if name.startswith("nanscan.cli.") and name not in CLI_SHARED}
    assert "nanscan.cli.main" in top
    importers = sorted(f"{name} imports {target}" for name in MODULES if name != "nanscan.__main__"
                       for target in _edges()[name] & top)
    assert importers == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_opens_with_a_purpose_line(name):
    docstring = ast.get_docstring(ast.parse(MODULES[name].read_text()))
    assert docstring and len(docstring.splitlines()[0]) > 20, f"{MODULES[name]} has no purpose line"


def test_deepspeed_is_imported_only_by_its_adapter():
    """`import nanscan` must not need DeepSpeed: only nanscan.integrations.deepspeed imports it."""
    importers = sorted(name for name in MODULES for _, target, _ in _imports(name)
                       if target == "deepspeed" or target.startswith("deepspeed."))
    assert set(importers) == {"nanscan.integrations.deepspeed"}
