"""Small models, datasets and planted faults for the framework integration tests, in an importable module so that
zero-config replay can import the classes the bundles name (tests/ is on sys.path in the test run).

Faults are planted by the collator (counting its calls: with gradient accumulation, call c is micro-batch
c % accumulation of optimizer step c // accumulation) or by a hook at a chosen optimizer step, never by a mock.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, IMAGE = 64, 8, 8


class Generated(torch.utils.data.Dataset):
    """`size` items, item i made by `make` from a generator seeded with i: the same on every run."""

    def __init__(self, make, size: int = 32):
        self.make, self.size = make, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return self.make(torch.Generator().manual_seed(i))


def token_row(g: torch.Generator) -> dict:
    ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def image_row(g: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g), "labels": torch.randint(0, 3, (), generator=g)}


def TokenData(size: int = 32) -> Generated:  # noqa: N802 - named as the dataset it gives
    return Generated(token_row, size)


def ImageData(size: int = 32) -> Generated:  # noqa: N802
    return Generated(image_row, size)


class PlantingCollator:
    """Stacks items into a batch; at call `at` (a micro-batch index over the run) plants a fault: "nan" puts a NaN
    in row `row` of `key`, "masked" sets every label to -100 (nothing left to predict: the loss is 0/0)."""

    def __init__(self, fault: str | None = None, at: tuple[int, ...] = (), key: str = "pixel_values", row: int = 1):
        self.fault, self.at, self.key, self.row = fault, set(at), key, row
        self.calls = 0

    def __call__(self, items: list[dict]) -> dict:
        batch = {k: torch.stack([item[k] for item in items]) for k in items[0]}
        if self.calls in self.at:
            if self.fault == "nan":
                batch[self.key][self.row].view(-1)[0] = float("nan")
            elif self.fault == "masked":
                batch["labels"][:] = -100
        self.calls += 1
        return batch


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                               num_labels=3))


def plant_bad_weight(model: nn.Module, name: str) -> None:
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[0] = float("inf")


# -- Lightning -------------------------------------------------------------------------------------------------

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the Lightning tests skip
    pl = None

if pl is not None:
    class TinyRegressor(pl.LightningModule):
        """A masked regression: the loss is the mean squared error over the rows whose mask is 1, so a batch
        with every row masked out divides 0 by 0."""

        def __init__(self, dim: int = 4, hidden: int = 8, lr: float = 0.05):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y, mask = batch
            err = ((self.net(x).squeeze(-1) - y) ** 2) * mask
            loss = err.sum() / mask.sum()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    class NoHparams(TinyRegressor):
        """Its constructor needs an argument that save_hyperparameters() never kept."""

        def __init__(self, width: int):
            pl.LightningModule.__init__(self)
            self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
            self.hparams.lr = 0.05


def regression_rows(count: int = 32, *, nan_rows: tuple[int, ...] = (), masked_rows: range | tuple = ()):
    """(x, y, mask) rows for TinyRegressor: NaN features in `nan_rows`, mask 0 in `masked_rows`."""
    g = torch.Generator().manual_seed(0)
    x, y, mask = torch.randn(count, 4, generator=g), torch.randn(count, generator=g), torch.ones(count)
    for row in nan_rows:
        x[row, 1] = float("nan")
    for row in masked_rows:
        mask[row] = 0.0
    return torch.utils.data.TensorDataset(x, y, mask)


def regression_dicts(count: int = 32, *, nan_rows: tuple[int, ...] = ()) -> list[dict]:
    """regression_rows as dict items with each row's dataset index under "id" (DictRegressor's batches)."""
    rows = regression_rows(count, nan_rows=nan_rows)
    return [{"x": x, "y": y, "mask": mask, "id": torch.tensor(i)} for i, (x, y, mask) in enumerate(rows)]


if pl is not None:
    class DictRegressor(TinyRegressor):
        """TinyRegressor over dict batches (x, y, mask and the rows' ids), calling self.net as TinyRegressor does."""

        def training_step(self, batch, batch_idx):
            return super().training_step((batch["x"], batch["y"], batch["mask"]), batch_idx)
