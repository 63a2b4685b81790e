"""How large is the history window per tensor-step? In a bundle: history.safetensors plus history.json, written
sparse (NOTE: [sparse history records] in nanscan.bundle.history) against the dense int64 records older bundles
hold. In memory: the Monitor's history ring of host scans (compact records, NOTE: [history ring]) and of GPU scans
(the device compaction's fixed buffers, laid out as on a GPU and filled by the kernels' CPU twin). On two sets:

  demo   the bundle `nanscan demo` writes (147 tensors, 64 steps), read back from its files;
  gpt2   GPT-2-small shapes (148 float32 parameters and their bfloat16 gradients), real scans of random tensors at
         four scales, cycled over 64 steps with a drift.

Prints lines such as

    demo: dense 2114.9 B, sparse 95.3 B per tensor-step; dense/sparse = 22.2x
    demo: ring in memory 112.0 B (host scans), 324.0 B (GPU scans, 100% of steps fit) per tensor-step

and checks, before printing, that the sparse payload decodes to exactly the records it was written from. Run it:

    .venv/bin/python benchmarks/bench_history_size.py --json benchmarks/results/bench_history_size.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_save

import nanscan
from nanscan._atomic import json_bytes, write_results_json
from nanscan.bundle import load_bundle
from nanscan.bundle.format import HistoryEntry
from nanscan.bundle.history import decode_records, history_payload
from nanscan.demo import run_demo
from nanscan.runtime.history import DeviceRecords, HistoryRing

GPT2 = {"n_layer": 12, "d_model": 768, "vocab": 50257, "n_ctx": 1024}
STEPS = 64
VARIANTS = 4


def gpt2_shapes() -> dict[str, tuple[int, ...]]:
    d, shapes = GPT2["d_model"], {"wte.weight": (GPT2["vocab"], GPT2["d_model"]),
                                  "wpe.weight": (GPT2["n_ctx"], GPT2["d_model"])}
    for i in range(GPT2["n_layer"]):
        for name, shape in [("ln_1.weight", (d,)), ("ln_1.bias", (d,)), ("attn.c_attn.weight", (d, 3 * d)),
                            ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.weight", (d, d)),
                            ("attn.c_proj.bias", (d,)), ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
                            ("mlp.c_fc.weight", (d, 4 * d)), ("mlp.c_fc.bias", (4 * d,)),
                            ("mlp.c_proj.weight", (4 * d, d)), ("mlp.c_proj.bias", (d,))]:
            shapes[f"h.{i}.{name}"] = shape
    return shapes | {"ln_f.weight": (d,), "ln_f.bias": (d,)}


def gpt2_entries() -> list[HistoryEntry]:
    """STEPS entries cycling over VARIANTS real scans: weights ~ N(0, 0.02) (LayerNorm weights near 1, biases
    near 0), bfloat16 gradients whose scale shrinks with the variant."""
    torch.manual_seed(0)
    reports = []
    for v in range(VARIANTS):
        tensors = {}
        for name, shape in gpt2_shapes().items():
            base = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
            tensors[f"param:{name}"] = base + 0.02 * torch.randn(shape)
            tensors[f"grad:{name}"] = (1e-3 / (1 + v) * torch.randn(shape)).bfloat16()
        reports.append(nanscan.scan(tensors))
        del tensors
    return [HistoryEntry(s, 3.0, 6e-4, 1.0, reports[s % VARIANTS]) for s in range(STEPS)]


def measure(entries: list[HistoryEntry]) -> dict:
    tensors, index = history_payload(entries)
    records = np.concatenate([e.report.records for e in entries])
    assert np.array_equal(decode_records(tensors), records), "the sparse payload does not decode to its records"
    dense_index = {k: v for k, v in index.items() if k != "records_format"}
    dense = {"records": torch.from_numpy(records), "row_offsets": tensors["row_offsets"]}
    tensor_steps = len(records)
    sizes = {"tensor_steps": tensor_steps, "tensors": len(entries[-1].report.records), "steps": len(entries),
             "json_bytes": len(json_bytes(index)), "dense_safetensors_bytes": len(safetensors_save(dense)),
             "sparse_safetensors_bytes": len(safetensors_save(tensors)),
             "hist_counts_dtype": str(tensors["hist_counts"].dtype)}
    sizes["dense_per_tensor_step"] = (sizes["dense_safetensors_bytes"] + len(json_bytes(dense_index))) / tensor_steps
    sizes["sparse_per_tensor_step"] = (sizes["sparse_safetensors_bytes"] + sizes["json_bytes"]) / tensor_steps
    sizes.update(ring_sizes(entries))
    return sizes


def ring_sizes(entries: list[HistoryEntry]) -> dict:
    """Bytes per tensor-step of the Monitor's history ring holding these steps: host scans' compact records, and
    the device compaction's buffers (or, for a step that does not fit them, its dense records)."""
    ring = HistoryRing(len(entries))
    device_bytes, fitted = 0, 0
    for entry in entries:
        report = entry.report
        ring.append_host(entry.step, report.tensors, report.records.copy(), (), report.backend)
        kept = DeviceRecords(len(report.records), torch.device("cpu"))
        kept.launch(torch.from_numpy(report.records.copy()), None)
        kept.resolve(wait=True)
        assert np.array_equal(kept.host_records(), report.records), "the device compaction is not exact"
        device_bytes, fitted = device_bytes + kept.nbytes, fitted + bool(kept.fits)
    assert all(np.array_equal(r.records, e.report.records) for (_, r), e in zip(ring.entries(), entries))
    tensor_steps = sum(len(e.report.records) for e in entries)
    return {"ring_host_per_tensor_step": ring.nbytes / tensor_steps,
            "ring_device_per_tensor_step": device_bytes / tensor_steps, "ring_device_fit_share": fitted / len(entries)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_demo(Path(tmp) / "demo")
        bundle = load_bundle(result.bundle_path)
        sets = {"demo": measure(bundle.history())}
        on_disk = sum((bundle.path / n).stat().st_size for n in ("history.safetensors", "history.json"))
        sets["demo"]["bundle_files_per_tensor_step"] = on_disk / sets["demo"]["tensor_steps"]
    sets["gpt2"] = measure(gpt2_entries())
    for name, s in sets.items():
        print(f"{name}: {s['tensors']} tensors x {s['steps']} steps, counts {s['hist_counts_dtype']}: dense "
              f"{s['dense_per_tensor_step']:.1f} B, sparse {s['sparse_per_tensor_step']:.1f} B per tensor-step; "
              f"dense/sparse = {s['dense_per_tensor_step'] / s['sparse_per_tensor_step']:.1f}x")
        print(f"{name}: ring in memory {s['ring_host_per_tensor_step']:.1f} B (host scans), "
              f"{s['ring_device_per_tensor_step']:.1f} B (GPU scans, {100 * s['ring_device_fit_share']:.0f}% of "
              "steps fit) per tensor-step")
    if args.json:
        print(f"wrote {write_results_json(args.json, {'sets': sets})}")


if __name__ == "__main__":
    main()
