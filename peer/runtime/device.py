"""Which device and precision this peer trains in: chosen from the flags, checked against the machine at start.

Each peer chooses for itself: precision is not a swarm setting (weights, optimizer state and averaging stay fp32),
so a bf16 GPU peer and an fp32 CPU peer train the same run together.
"""
from __future__ import annotations

from typing import List

import torch


class DeviceUnavailable(ValueError):
    """The requested device or precision does not exist on this machine (bad input: exit 2)."""


def cuda_devices() -> List[str]:
    """'cuda:N (name)' for every GPU torch sees."""
    if not torch.cuda.is_available():
        return []
    return [f"cuda:{index} ({torch.cuda.get_device_name(index)})" for index in range(torch.cuda.device_count())]


def resolve_device(requested: str) -> torch.device:
    """auto, cpu, cuda or cuda:N -> the device, made current so that CUDA calls without one go to it.

    :raises DeviceUnavailable: naming the devices that exist
    """
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    existing = cuda_devices()
    if not existing:
        raise DeviceUnavailable(f"--device {requested}: this machine has no CUDA device that torch can use (torch "
                                f"{torch.__version__}); use --device cpu or auto")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= len(existing):
        raise DeviceUnavailable(f"--device {requested}: there is no GPU {index}; this machine has "
                                f"{', '.join(existing)}")
    torch.cuda.set_device(index)  # the GPU memory gauges and any task code that says "cuda" use this one
    return torch.device("cuda", index)


def describe_device(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto, fp32, bf16 or fp16 -> the precision to train in on this device.

    auto is bf16 on a GPU that supports it, else fp32 (on a CPU, bf16 autocast works but is rarely faster, so it
    is only used when asked for).
    :raises DeviceUnavailable: fp16 off a GPU, or bf16 on a GPU without it
    """
    on_gpu = device.type == "cuda"
    if requested == "auto":
        return "bf16" if on_gpu and torch.cuda.is_bf16_supported() else "fp32"
    if requested == "fp16" and not on_gpu:
        raise DeviceUnavailable("--precision fp16 needs a CUDA device (fp16 autocast and its loss scaler are for "
                                f"GPUs), and this peer trains on {device}; use --precision bf16 or fp32 there")
    if requested == "bf16" and on_gpu and not torch.cuda.is_bf16_supported():
        raise DeviceUnavailable(f"--precision bf16: {describe_device(device)} does not support bf16; use "
                                f"--precision fp16 or fp32")
    return requested
