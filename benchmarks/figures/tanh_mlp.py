"""The small LightningModule the overlap figures train: an nn.Sequential of Linear+Tanh blocks.

``training_step`` returns the mean square of the output; the weights are seeded (``torch.manual_seed(0)``)
so that two fits of the same shape start alike. The optimizer is the caller's: ``optimizer`` takes the
parameters and returns the optimizer (``functools.partial(torch.optim.SGD, lr=1e-3)``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import lightning as L
import torch
from torch import nn


class TanhMLP(L.LightningModule):
    def __init__(self, width: int, depth: int,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.optimizer = optimizer

    def training_step(self, batch, i):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return self.optimizer(self.parameters())
