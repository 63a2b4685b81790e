"""Regression case export: a bundle's smallest failing samples (with state and RNG) and a pytest file that keeps
the step finite once fixed (`nanscan export-regression`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from nanscan._atomic import atomic_directory, atomic_write_bytes, json_bytes
from nanscan.bundle import Bundle, plain_json
from nanscan.bundle.tree import TreeEncoder, for_saving
from nanscan.engine.inputs import iter_batch_tensors
from nanscan.bundle.provenance import rng_to_tensors
from nanscan.replay.bisect import bisect_samples
from nanscan.replay.options import DEFAULT_MAX_STATE_MB
from nanscan.replay.replayer import Replayer
from nanscan.replay.reproduce import recorded_replay
from nanscan.replay.step import ReplayError, StepOptions, StepOutcome, map_tensors, sample_ids_of, select_samples

REGRESSION_SCHEMA = "nanscan.regression/1"


CASE_JSON = "case.json"


CASE_BATCH = "batch.safetensors"


CASE_STATE = "state.safetensors"


CASE_RNG = "rng.safetensors"


@dataclass
class ExportResult:
    case_dir: str
    test_file: str
    indices: list[int]
    sample_ids: list | None
    reproduced: bool  # the exported samples went non-finite when replayed
    with_state: bool
    notes: list[str]
    error: str | None = None  # the error the replay of the exported samples raised, if it did
    changed: bool = True  # False when the same export was already there

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "case"


def _state_bytes(state: Mapping | None) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_batch_tensors(state or {}))


def export_regression(bundle: Bundle | str | os.PathLike, dest: str | os.PathLike, entry: str | None = None, *,
                      samples: Sequence[int] | None = None, with_state: bool | None = None,
                      max_state_mb: float = DEFAULT_MAX_STATE_MB, overwrite: bool = False,
                      xfail: bool = False, trust_bundle_paths: bool = False) -> ExportResult:
    """Write the bundle's minimal failing sample(s) as a regression case under `dest`:
    `<dest>/<case>/` (case.json, batch.safetensors, state.safetensors unless too large, rng.safetensors) and
    `<dest>/test_<case>.py`, a pytest file calling nanscan.testing.assert_step_finite.

    Samples: `samples` (row indices), else the bundle's replay finding, else a fresh bisection. `with_state`: store
    the model and optimizer state (default: when it is at most `max_state_mb`). Writing is atomic and idempotent:
    the same bundle exported again gives the same files. A file or directory of the same name that this function
    did not write is never replaced; an earlier export that differs is replaced only with `overwrite`.
    `xfail`: mark the test `pytest.mark.xfail(strict=True)`, so it can be committed before the fix (it passes as
    an expected failure) and fails once the step is finite, when the mark is to be removed.
    The test follows the trust rule (NOTE: [trust rule] in nanscan/entry.py): an `entry` given here is written into
    the test's source, the code its reader commits; otherwise the test calls the bundle's entry only if it is
    marked. trust_bundle_paths: as for Replayer.
    """

    replayer = Replayer(bundle, entry, trust_bundle_paths=trust_bundle_paths)
    b = replayer.bundle
    notes: list[str] = list(replayer.notes)
    size = replayer.sample_count
    if samples is None:
        recorded = recorded_replay(b) or {}
        if (recorded.get("bisect") or {}).get("applicable") and recorded.get("entry") == replayer.entry:
            samples = recorded["bisect"]["indices"]
        elif size is not None and size >= 2:
            found = bisect_samples(replayer)
            samples = found.indices if found.applicable else None
            if not found.applicable:
                notes.append(f"whole batch exported: {found.reason}")
            elif not found.minimal:
                notes.append(found.describe())
    else:
        samples = [int(i) for i in samples]
        outside = [i for i in samples if size is None or not 0 <= i < size]
        if outside or not samples or len(set(samples)) != len(samples):
            raise ReplayError(f"samples {samples}: give distinct row numbers from 0 to {(size or 0) - 1} (the batch "
                              f"in {b.path} has {size if size is not None else 'no'} samples)")
    indices = list(range(size)) if samples is None and size is not None else [int(i) for i in samples or []]
    options = StepOptions(deterministic=True)
    if samples is None:
        case_batch = replayer.batch
    else:
        case_batch = select_samples(replayer.batch, indices, replayer.build())
    observed = replayer.run(options, batch=case_batch, localize=True)
    notes += [n for n in replayer.notes if n not in notes]  # the first run says whether the run's autocast applies
    if observed.error is not None:
        notes.append(f"replaying the exported samples raised an error ({observed.error}): the test fails with "
                     "that error, not with a non-finite step; fix the replay entry or export other samples")
    elif observed.finite:
        notes.append("the exported samples do not fail when replayed: the test will pass as is")

    if with_state is None:
        with_state = _state_bytes(replayer.model_state) + _state_bytes(replayer.optimizer_state) \
            <= max_state_mb * (1 << 20)
        if not with_state and replayer.model_state is not None:
            notes.append(f"state not exported (over {max_state_mb} MB): the test runs on the entry's freshly "
                         "built model; pass --with-state to include it")
    with_state = with_state and replayer.model_state is not None

    name = _slug(f"nanscan_{b.manifest['run_id']}_step{b.step}")
    dest = Path(dest)
    case_dir = dest / name
    test_file = dest / f"test_{name}.py"
    batch_encoder = TreeEncoder(".")
    batch_structure = batch_encoder.encode(map_tensors(case_batch, lambda t: t.detach().cpu()))
    case: dict[str, Any] = {
        "schema": REGRESSION_SCHEMA,
        "source": {"bundle": str(b.path), "run_id": b.manifest["run_id"], "step": b.step, "category": b.category,
                   "batch_sha256": b.manifest["batch"].get("sha256"), "config_sha256": b.manifest["config_sha256"]},
        "replay_entry": replayer.entry, "entry_given": not replayer.entry_from_bundle, "config": b.config,
        "samples": {"indices": indices, "sample_ids": sample_ids_of(b.sample_ids, indices, size),
                    "batch_size": size},
        "expected": {"finite": True},
        "observed": observed.to_dict(),
        "batch": {"file": CASE_BATCH, "structure": batch_structure},
        "state": None, "rng": None, "notes": notes,
    }
    if replayer.autocast:  # the run's autocast region, which the test re-applies (NOTE: [replayed precision])
        case["autocast"] = plain_json(replayer.autocast, "autocast")
    if with_state:
        state_encoder = TreeEncoder("/")
        structure = {"model": state_encoder.encode(dict(replayer.model_state), ("model",)),
                     "optimizer": (state_encoder.encode(replayer.optimizer_state, ("optimizer",))
                                   if replayer.optimizer_state is not None else None)}
        case["state"] = {"file": CASE_STATE, "structure": structure, "pre_step": replayer.pre_step}
    if replayer.rng is not None:
        case["rng"] = {"file": CASE_RNG}
    # Everything is rendered first, so an earlier export can be compared byte for byte before anything is written.
    contents = {CASE_BATCH: _tensor_bytes(batch_encoder.tensors)}
    if with_state:
        contents[CASE_STATE] = _tensor_bytes(state_encoder.tensors)
    if replayer.rng is not None:
        tensors, meta = rng_to_tensors(replayer.rng)
        contents[CASE_RNG] = _tensor_bytes(tensors, {"nanscan.rng": json.dumps(meta, sort_keys=True)})
    contents[CASE_JSON] = json_bytes(plain_json(case))
    source = _test_source(name, case, observed, xfail=xfail).encode("utf-8")

    if dest.exists() and not dest.is_dir():
        raise ReplayError(f"{dest} is a file; pass a directory for the regression case")
    case_same, test_same = _check_earlier_export(case_dir, contents, test_file, source, name, overwrite)
    dest.mkdir(parents=True, exist_ok=True)
    if not case_same:
        _replace_directory(case_dir, contents)
    if not test_same:
        atomic_write_bytes(test_file, source)
    ids = case["samples"]["sample_ids"]
    return ExportResult(str(case_dir), str(test_file), indices, ids, not observed.finite and observed.error is None,
                        bool(with_state), notes, observed.error, changed=not (case_same and test_same))


def _tensor_bytes(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save  # noqa: PLC0415


    return save(for_saving(tensors), metadata=metadata)


_TEST_HEADER = '"""Regression case exported by nanscan'


def _check_earlier_export(case_dir: Path, contents: Mapping[str, bytes], test_file: Path, source: bytes, name: str,
                          overwrite: bool) -> tuple[bool, bool]:
    """(case unchanged, test unchanged) against what is already at those paths. Refuses anything export-regression
    did not write (a user's file or directory of the same name), and an earlier export that differs from this
    one unless `overwrite`: it may have been edited (a config changed to test a fix)."""
    def refuse(path: Path, what: str) -> ReplayError:
        return ReplayError(f"{path} already exists and {what}, so it was not written by `nanscan export-regression`; "
                           "nothing was written: move it away or choose another directory")

    differs = []
    case_same = test_same = False
    if case_dir.is_symlink() or case_dir.exists():
        if case_dir.is_symlink() or not case_dir.is_dir():
            raise refuse(case_dir, "is not a directory")
        found = {p.name: p for p in case_dir.iterdir()}
        foreign = sorted(n for n, p in found.items()
                         if n not in (CASE_JSON, CASE_BATCH, CASE_STATE, CASE_RNG) or p.is_symlink() or not p.is_file())
        if foreign:
            raise refuse(case_dir, f"holds {', '.join(foreign[:5])}")
        meta = None
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads(found[CASE_JSON].read_bytes()) if CASE_JSON in found else None
        if not isinstance(meta, dict) or meta.get("schema") != REGRESSION_SCHEMA:
            raise refuse(case_dir, f"has no {CASE_JSON} of schema {REGRESSION_SCHEMA}")
        case_same = set(found) == set(contents) and all(found[f].read_bytes() == data for f, data in contents.items())
        if not case_same:
            differs.append(str(case_dir))
    if test_file.is_symlink() or test_file.exists():
        text = test_file.read_bytes() if test_file.is_file() and not test_file.is_symlink() else b""
        if not (text.startswith(_TEST_HEADER.encode()) and f'parent / "{name}"'.encode() in text):
            raise refuse(test_file, "is not the test file of this case")
        test_same = text == source
        if not test_same:
            differs.append(str(test_file))
    if differs and not overwrite:
        raise ReplayError(f"an earlier export differs from this one in {' and '.join(differs)} (edited since, or "
                          "exported from another bundle or samples); nothing was written: pass --overwrite to "
                          "replace it, or choose another directory")
    return case_same, test_same


def _replace_directory(case_dir: Path, contents: Mapping[str, bytes]) -> None:
    """Put a directory holding `contents` at case_dir: built beside it, the old one parked, swapped, deleted."""
    import shutil  # noqa: PLC0415


    old = None
    if case_dir.exists():
        old = case_dir.with_name(f".tmp-{case_dir.name}-old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(case_dir, old)
    try:
        with atomic_directory(case_dir) as temp:
            for file, data in contents.items():
                (temp / file).write_bytes(data)
    except BaseException:
        if old is not None and not case_dir.exists():
            os.rename(old, case_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _in_docstring(text: str) -> str:
    """`text` as it can stand inside a triple-quoted docstring: sample ids are the user's data, and a quote, a
    backslash or a control character in one must not end the string or break the generated file."""
    def escape(ch: str) -> str:
        if ch in '\\"':
            return "\\" + ch
        code = ord(ch)
        if (code < 32 and ch != "\n") or code == 127 or 0xD800 <= code <= 0xDFFF:
            return f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}"
        return ch

    return "".join(escape(ch) for ch in text)


def _test_source(name: str, case: Mapping, observed: StepOutcome, *, xfail: bool = False) -> str:
    src = case["source"]
    loc = observed.localization
    if observed.error is not None:
        seen = f"raised an error when exported ({observed.error})"
    elif loc is not None:
        seen = f"went non-finite ({observed.category}), first in {loc.label} ({loc.module_type}, {loc.phase})"
    else:
        seen = "went non-finite" if not observed.finite else "was finite when exported"
    ids = case["samples"]["sample_ids"]
    which = f"samples {ids}" if ids is not None else f"rows {case['samples']['indices']}"
    promise = ("This test fails until that cause is fixed, and then keeps the edge case from coming back unnoticed."
               if not observed.finite else
               "This test passed when it was written (the samples did not fail on replay); it guards the step only.")
    about = _in_docstring(f"""from run {src["run_id"]}, step {src["step"]} (category {src["category"]}).

The training step on {which} {seen}.
{promise}
The case (batch, state, RNG states, config) is in ./{name}/; the model comes from the replay entry
{case["replay_entry"]!r}, which must be importable here.""")
    # NOTE: [trust rule]: an entry the exporter chose is in the test's code, so committing the test chooses it.
    entry_line, entry_arg = ("", "") if not case["entry_given"] else (f"ENTRY = {case['replay_entry']!r}\n", "ENTRY")
    # NOTE: [replayed precision]: the run's autocast around step_fn, unless the entry enters its own
    precision_import, options_arg = "", ""
    if case.get("autocast"):
        precision_import = "from nanscan.replay.step import StepOptions, with_run_precision\n"
        options_arg = ',\n                       options=with_run_precision(spec, StepOptions(), case.meta["autocast"])'
    pytest_import, mark = "", ""
    if xfail:
        pytest_import = "import pytest\n\n"
        mark = ('@pytest.mark.xfail(strict=True, reason="fails until the cause is fixed; then this test fails '
                'as XPASS: remove this mark")\n')
    return f'''{_TEST_HEADER} {about}
"""

from pathlib import Path

{pytest_import}{precision_import}from nanscan.testing import assert_step_finite, load_regression_case

CASE = Path(__file__).resolve().parent / "{name}"
{entry_line}

{mark}def test_{name}_stays_finite():
    case = load_regression_case(CASE)
    spec = case.build_spec({entry_arg})
    case.restore_rng()
    assert_step_finite(spec.model, spec.step_fn, case.batch, optimizer=spec.make_optimizer(),
                       state=case.model_state, optimizer_state=case.optimizer_state{options_arg})
'''
