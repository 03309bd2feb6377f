"""What this machine is, as far as speed decisions go: the CPU model and the ISA features that decide how bf16 runs
and how a forward over several tokens costs against a one-token forward."""

import platform
from pathlib import Path

import torch

__all__ = ["ISA_FLAGS", "cpu_record", "fast_bf16"]

#: /proc/cpuinfo flags that decide how a forward over several tokens costs against a one-token forward
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8", "asimd", "sve", "bf16")
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_record() -> tuple[str, list[str]]:
    """CPU model name and which of `ISA_FLAGS` it has (x86 `flags`, Arm `Features`)."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    cpu = model or platform.processor() or platform.machine()
    return cpu, [f for f in ISA_FLAGS if f in flags]


def fast_bf16(device: str | torch.device | None = None) -> bool:
    """Whether bf16 arithmetic is native on `device` (default: CUDA when available, else the CPU). On a CPU without
    AVX512-BF16/AMX (or Arm BF16) torch emulates it, and bf16 training there ran over 10x slower than fp32."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(NATIVE_BF16_FLAGS & set(cpu_record()[1]))
