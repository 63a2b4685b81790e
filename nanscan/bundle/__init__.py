"""The evidence bundle (nanscan.bundle.format describes its files): write_bundle at an incident, load_bundle to read
one back safely, a bundle set for a distributed incident. Modules: format (names, records, JSON helpers), tree
(nested tensors as safetensors), history (the history window on disk), incident_md (INCIDENT.md and its ledger),
write, read (validation, the Bundle), rank_set (the multi-rank set)."""

from __future__ import annotations

import os
from pathlib import Path

from nanscan.bundle.format import (BundleError, HistoryEntry, Incident, bundle_path, check_run_id, float_from_json,
                                   json_float, plain_json)
from nanscan.bundle.rank_set import BundleSet, bundle_set_root, load_bundle_set
from nanscan.bundle.read import Bundle, iter_bundles, open_single
from nanscan.bundle.write import read_log_tail, write_bundle

__all__ = ["Bundle", "BundleError", "BundleSet", "HistoryEntry", "Incident", "bundle_path", "check_run_id",
           "float_from_json", "iter_bundles", "json_float", "load_bundle", "plain_json", "read_log_tail",
           "write_bundle"]


def load_bundle(path: str | os.PathLike, *, whole_set: bool = True) -> "Bundle":
    """Open and validate a bundle: its schema, and every file's presence, size and sha256.

    `path` is the step directory, or a run directory holding exactly one bundle. Raises BundleError, naming the
    file and what to do, for a missing, truncated, modified or foreign bundle.
    A distributed incident's set (a step directory with index.json and rank-<r> parts), or one part of it, opens
    as a nanscan.bundle.BundleSet covering every part; `whole_set=False` opens just the one part.
    """
    if whole_set:
        found = bundle_set_root(Path(path))
        if found is not None:
            return load_bundle_set(*found)
    return open_single(path)
