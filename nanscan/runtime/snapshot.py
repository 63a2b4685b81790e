"""Exact pre-step copies of the model and optimizer state (Monitor(snapshot="cpu")), in CPU buffers allocated
once and overwritten at the start of every training step."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import torch


class CpuSnapshot:
    """Copies of the model and optimizer state in CPU buffers that are allocated once and overwritten each step
    (pinned when the source is on a GPU, so the copy runs asynchronously).

    `local(t)`: what of a tensor this process copies; nanscan.runtime.distributed passes its local shard for DTensors
    (FSDP2), whose global shape is not this rank's to allocate, and whose copy must not communicate."""

    def __init__(self, local: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.local = local
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._async = False
        self.model_state: dict | None = None
        self.optimizer_state: dict | None = None

    def spare(self) -> "CpuSnapshot":
        """An empty snapshot that copies the same way (the second buffer of mode="async")."""
        return CpuSnapshot(self.local)

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if self.local is not None:
            t = self.local(t)
        self._used.add(key)
        buf = self._buffers.get(key)
        on_gpu = t.device.type == "cuda"
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=on_gpu)
            self._buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=on_gpu)
        self._async |= on_gpu
        return buf

    def _copy_tree(self, value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy(key, value)
        if isinstance(value, Mapping):
            return {k: self._copy_tree(v, f"{key}/{k}") for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._copy_tree(v, f"{key}/{i}") for i, v in enumerate(value))
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return copy.deepcopy(value)

    def capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._used = set()
        with torch.no_grad():
            self.model_state = self._copy_tree(model.state_dict(), "model")
            self.optimizer_state = self._copy_tree(optimizer.state_dict(), "optimizer") if optimizer else None
        for stale in set(self._buffers) - self._used:  # e.g. optimizer state that was reset
            del self._buffers[stale]

    def result(self) -> tuple[dict | None, dict | None]:
        if self._async:
            torch.cuda.synchronize()
        return self.model_state, self.optimizer_state
