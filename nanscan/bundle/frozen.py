"""Frozen weights in a bundle by reference: each one's name, dtype, shape and sha256 in the manifest, its bytes left
out, and the comparison a replay makes of them with the model its entry builds.

NOTE: [frozen references]
A fine-tuned model's frozen parameters (requires_grad=False: a LoRA's base weights, 17 MB of a 3.7M-parameter
GPT-2's state) are the same at every step of a run and in every bundle it writes, and the replay entry that
rebuilds the model loads them from where the run did (a checkpoint, a hub revision) anyway. So a bundle holds each
frozen tensor of the model state as {dtype, shape, sha256 of its bytes} under the manifest's state.frozen, not in
state.safetensors; its digest is taken once, when the bundle is written (never in the training step). Kept whole
instead: a frozen tensor with a NaN or an infinity (it is the evidence, and no entry rebuilds it), one that is not a
plain dense tensor, a distributed rank's part (its pieces are shards no rebuilt model holds), and everything under
Monitor(frozen_weights="copy"). A replay (nanscan.replay.Replayer) takes these tensors from the model its entry
built, after checking each against its reference: one whose bytes, dtype or shape differ, or that the model lacks
or holds on the meta device (so it cannot be checked), stops the replay with their names, as a replay on other base
weights would answer another question. Reading a bundle still runs nothing: the references are JSON, checked for
their types before use.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping, Sequence

import torch

DIGEST = re.compile(r"^[0-9a-f]{64}$")


def tensor_sha256(t: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes in row-major order (its dtype and shape are recorded beside it)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).hexdigest()


def describe(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}


def _referable(t: Any) -> bool:
    """A dense, finite, floating tensor with its bytes at hand: one a rebuilt model can be checked against."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return False
    if not (t.is_floating_point() or t.is_complex()):
        return False
    return bool(torch.isfinite(t).all())


def split_frozen(model_state: Mapping[str, Any], keys: Sequence[str]) -> tuple[dict[str, Any], dict[str, dict]]:
    """(the model state without the frozen tensors it holds by reference, their references by state key)."""
    wanted = set(keys)
    kept, frozen = {}, {}
    for key, value in model_state.items():
        if key in wanted and _referable(value):
            frozen[key] = describe(value)
        else:
            kept[key] = value
    return kept, frozen


def reference_errors(value: Any) -> list[str]:
    """What is wrong with a manifest's state.frozen (for the reader's type check), as 'field (what it should be)'."""
    if value is None:
        return []
    ok = isinstance(value, dict) and all(
        isinstance(key, str) and isinstance(ref, dict) and isinstance(ref.get("dtype"), str)
        and isinstance(ref.get("shape"), list)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in ref["shape"])
        and isinstance(ref.get("sha256"), str) and DIGEST.match(ref["sha256"]) is not None
        for key, ref in value.items())
    return [] if ok else ["state.frozen (an object mapping each state key to its dtype, shape and sha256)"]


def compare(references: Mapping[str, Mapping], state: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(the keys whose tensor in `state` differs from its reference in bytes, dtype or shape; the keys it cannot
    check: missing from `state`, not a tensor, or on the meta device)."""
    differ, unchecked = [], []
    for key, ref in references.items():
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.layout != torch.strided:
            unchecked.append(key)
        elif str(t.dtype).removeprefix("torch.") != ref["dtype"] or list(t.shape) != list(ref["shape"]) or \
                tensor_sha256(t) != ref["sha256"]:
            differ.append(key)
    return differ, unchecked


def shown(keys: Sequence[str], limit: int = 5) -> str:
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
