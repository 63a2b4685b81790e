"""The evidence bundle (nanscan.bundle.format describes its files): write_bundle at an incident, load_bundle to read
one back safely, a bundle set for a distributed incident. Modules: format (names, records, JSON helpers), tree
(nested tensors as safetensors), history (the history window on disk), incident_md (INCIDENT.md and its ledger),
divergence (which tensors grew first before an incident), frozen (frozen weights by reference), provenance (source,
config, RNG), findings, write, read (validation, the Bundle), rank_set (the multi-rank set), cli.

Every public name is loaded on first use (module __getattr__, PEP 562), as nanscan's own are: reading and writing
bundles needs torch, which `nanscan note --help` and the other subcommands' help must not import (NOTE: [fast help]
in nanscan/cli/main.py). format, the names and JSON helpers, needs neither torch nor numpy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from nanscan._lazy import lazy_names

# public name -> the module that defines it (load_bundle is defined here); also the three helpers load_bundle joins,
# importable from here as they always were
_HOMES = {
    "BundleError": "nanscan.bundle.format", "HistoryEntry": "nanscan.bundle.format",
    "Incident": "nanscan.bundle.format", "bundle_path": "nanscan.bundle.format",
    "check_run_id": "nanscan.bundle.format", "float_from_json": "nanscan.bundle.format",
    "json_float": "nanscan.bundle.format", "plain_json": "nanscan.bundle.format",
    "BundleSet": "nanscan.bundle.rank_set", "bundle_set_root": "nanscan.bundle.rank_set",
    "load_bundle_set": "nanscan.bundle.rank_set",
    "Bundle": "nanscan.bundle.read", "iter_bundles": "nanscan.bundle.read", "open_single": "nanscan.bundle.read",
    "read_log_tail": "nanscan.bundle.write", "write_bundle": "nanscan.bundle.write",
    "BundleWriteError": "nanscan.bundle.write", "unsaved_parts": "nanscan.bundle.write",
}

__all__ = ["Bundle", "BundleError", "BundleSet", "BundleWriteError", "HistoryEntry", "Incident", "bundle_path",
           "check_run_id", "float_from_json", "iter_bundles", "json_float", "load_bundle", "plain_json",
           "read_log_tail", "unsaved_parts", "write_bundle"]

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ loads each name
    from nanscan.bundle.format import (BundleError, HistoryEntry, Incident, bundle_path, check_run_id,
                                       float_from_json, json_float, plain_json)
    from nanscan.bundle.rank_set import BundleSet
    from nanscan.bundle.read import Bundle, iter_bundles
    from nanscan.bundle.write import BundleWriteError, read_log_tail, unsaved_parts, write_bundle


def load_bundle(path: str | os.PathLike, *, whole_set: bool = True) -> "Bundle":
    """Open and validate a bundle: its schema, and every file's presence, size and sha256.

    `path` is the step directory, or a run directory holding exactly one bundle. Raises BundleError, naming the
    file and what to do, for a missing, truncated, modified or foreign bundle.
    A distributed incident's set (a step directory with index.json and rank-<r> parts), or one part of it, opens
    as a nanscan.bundle.BundleSet covering every part; `whole_set=False` opens just the one part.
    """
    from nanscan.bundle.rank_set import bundle_set_root, load_bundle_set  # noqa: PLC0415 - NOTE: [fast help]
    from nanscan.bundle.read import open_single  # noqa: PLC0415

    if whole_set:
        found = bundle_set_root(Path(path))
        if found is not None:
            return load_bundle_set(*found)
    return open_single(path)


lazy_names(__name__, _HOMES, __all__)
