"""The MLP sizes of the DDP study, apart from torch so the CLI can list them without importing it."""

from __future__ import annotations

MODELS: dict[str, tuple[int, int, int]] = {
    # name: (input width, hidden width, hidden layers) of an MLP; S: 1.3 M parameters, M: 9.5 M
    "S": (256, 1024, 1),
    "M": (512, 2048, 2),
}
