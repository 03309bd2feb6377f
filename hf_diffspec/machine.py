"""What this machine is, as far as speed decisions go: the CPU model and the ISA features that decide how bf16 runs
and how a forward over several tokens costs against a one-token forward, and the record every benchmark report starts
with (`machine_description`): CPU model and ISA features or GPU, threads, dtype and the measured verify-cost curve,
which decide whether verifying several tokens at once pays."""

import os
import platform
from pathlib import Path

import torch
import transformers

__all__ = ["CURVE_SIZES", "ISA_FLAGS", "cpu_record", "fast_bf16", "machine_description", "machine_markdown",
           "verify_cost_curve"]

#: /proc/cpuinfo flags that decide how a forward over several tokens costs against a one-token forward
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8", "asimd", "sve", "bf16")
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
#: n of the verify-cost curve T_verify(1, n) / T_verify(1, 1) in the machine record
CURVE_SIZES = (1, 2, 4, 8, 16)


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


def verify_cost_curve(target, sizes=CURVE_SIZES) -> dict | None:
    """T_verify(1, n) / T_verify(1, 1) for n in `sizes` from the target's verify-cost profile as this process has it
    (describing the machine measures nothing: the bench obtains the profile before it runs), T_verify(1, 1) in ms
    and the profile's file (`hf-diffspec profile` re-measures it); None when there is none."""
    from .runtime.control_profiles import profile_dir, profile_key, verify_cost_for

    cost = verify_cost_for(target, measure=False)
    if cost is None:
        return None
    one = cost.profiled(1, 1)
    return {"ms_one_token": round(one * 1000, 2), "ratio": {str(n): round(cost.profiled(n, 1) / one, 3) for n in sizes},
            "profile": str(profile_dir() / f"{profile_key(target)}.json")}


def machine_description(target=None) -> dict:
    """What decides the result: CPU model and ISA features, GPU, threads, versions; with `target`, its device and
    dtype and its measured verify-cost curve."""
    cpu, isa = cpu_record()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    machine = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "isa_flags": isa,
        "avx512": "avx512f" in isa, "native_bf16": bool(NATIVE_BF16_FLAGS & set(isa)),
        "amx": "amx_tile" in isa, "gpu": gpu, "device": gpu or "cpu", "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    if target is not None:
        machine.update(target_device=str(target.device), dtype=str(target.dtype).replace("torch.", ""),
                       verify_cost_curve=verify_cost_curve(target))
    return machine


def machine_markdown(machine: dict) -> str:
    """The machine record as the lines printed above the results."""
    yes = lambda flag: "yes" if machine.get(flag) else "no"  # noqa: E731
    isa = ", ".join(machine["isa_flags"]) or "none found"
    lines = [f"**Machine:** {machine['cpu']} ({machine['cpu_count']} CPUs; ISA {isa}: AVX-512 {yes('avx512')}, "
             f"native bf16 {yes('native_bf16')}, AMX {yes('amx')}); GPU {machine['gpu'] or 'none'}; torch "
             f"{machine['torch']} with {machine['torch_threads']} threads, transformers {machine['transformers']}"]
    if "dtype" in machine:
        curve = machine.get("verify_cost_curve")
        if curve is None:
            measured = "not measured (HF_DIFFSPEC_AUTO_PROFILE=0 and no profile: run `hf-diffspec profile`)"
        else:
            measured = ", ".join(f"n={n}: {r:.2f}" for n, r in curve["ratio"].items())
            measured += f" (T_verify(1, 1) = {curve['ms_one_token']:.1f} ms; profile {curve['profile']})"
        lines.append(f"**Target:** {machine['dtype']} on {machine['target_device']}; verify cost "
                     f"T_verify(1, n) / T_verify(1, 1): {measured}")
    return "\n\n".join(lines)
