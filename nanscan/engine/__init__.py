"""The scan engine: one fused pass over many tensors, exact on every backend. Modules, bottom up: _layout (the
native record's Python mirror), _native (the compiled extension, loaded once), compact (the history's compact
records), inputs (flat views and the input table), backends/ (cpu, cuda, numba, numba-cuda, reference), dispatch
(each device's inputs to its backend), pending (a scan's records now or later), stats (ScanReport, TensorStats),
headroom (low-precision headroom from the exponent histograms), plans (the per-step inputs of a model and a batch),
fingerprint (two state dicts compared by their scans' fingerprints, NOTE: [scan fingerprint]).

Nothing here knows a training loop, a bundle or a command: the layers above (nanscan.runtime, nanscan.bundle, the
tools) build on it (ARCHITECTURE.md). Importing this package imports nothing: its modules are taken by name.
"""
