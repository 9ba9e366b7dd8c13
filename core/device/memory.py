"""Device memory: the regions the emulated GPU owns, as torch tensors on the best device."""

from __future__ import annotations

import hashlib

import torch


def best_device(prefer: str | None = None) -> torch.device:
    """CUDA when present (or asked for), else CPU."""
    if prefer:
        return torch.device(prefer)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_label(device: torch.device) -> str:
    """How the platform names the device in reports: ``cpu``, or ``cuda (NVIDIA H100 80GB HBM3)``."""
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


class Region:
    """A named byte region of device memory."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, nbytes: int, device: torch.device) -> None:
        self.name = name
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    def write(self, data: bytes) -> None:
        if len(data) != self.nbytes:
            self.tensor = torch.zeros(len(data), dtype=torch.uint8, device=self.tensor.device)
        if data:
            self.tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def digest(self) -> str:
        return hashlib.sha256(self.tensor.cpu().numpy().tobytes()).hexdigest()

    def zero_and_check(self, start: int = 0, end: int | None = None) -> bool:
        view = self.tensor[start:end]
        view.zero_()
        return not bool(view.any().item())
