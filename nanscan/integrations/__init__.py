"""Framework adapters: hooks of a trainer turned into Monitor calls, one module per framework.

    nanscan.integrations.transformers.NanscanCallback   transformers.Trainer(callbacks=[...])
    nanscan.integrations.lightning.NanscanCallback      lightning.Trainer(callbacks=[...]) (pytorch_lightning too)
    nanscan.integrations.accelerate.monitor             a hand-written accelerate loop
    nanscan.integrations.deepspeed.DeepSpeedMonitor     a DeepSpeed engine (ZeRO 0-3): each rank's partitions
    nanscan.integrations.tensorboard                    Monitor(tensorboard=...): live statistics in TensorBoard
    nanscan.integrations.wandb                          Monitor(wandb=run): the same statistics in a W&B run

Each adapter imports its framework itself, so importing nanscan (or this package) imports none of them. What they
share lives in `session` (one optimizer step's micro-batches, the check, the policy, the numbers for the logs) and
`rebuild` (what a bundle records so that `nanscan replay` rebuilds the step without a user-written entry); the
live exports share `live` (what is written at which step, for every sink).
"""

__all__: list[str] = []
