"""The every-step path inside a training loop: the Monitor (monitor: check() as its stages, NOTE: [check stages];
verdict: a bad step's incident, bundle and policy, overflow skips and spikes; update: the post-update check),
the default Monitor behind nanscan.check (default), GradScaler awareness (amp), spike statistics (spikes), the
history ring (history), the exact pre-step state (snapshot), the run's window (window) and the ranks' agreement
(distributed).

New every-step features (replica agreement, rollback) are modules here, joined to check() as stages, as the
window is. Importing this package imports nothing: its modules are taken by name (nanscan.Monitor is the public
face).
"""
