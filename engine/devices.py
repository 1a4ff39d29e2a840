"""Which torch device a command runs on: "cpu" or a CUDA device (one code path for both; NCCL vs gloo and
every tensor's placement follow from it)."""

from __future__ import annotations

import re


def check_device(device: str) -> None:
    """ValueError (a one-line CLI message) unless `device` is "cpu" or a CUDA device this machine has."""
    if device == "cpu":
        return
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__})")
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def device_name(device: str) -> str:
    """What the report says ran the bench: "cpu", or the GPU's own name (timings only compare on one card)."""
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device
