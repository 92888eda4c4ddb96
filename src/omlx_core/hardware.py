"""What machine this is: the facts that decide which kernels, lanes and profiles apply."""

import hashlib
import json
import platform
import shutil
import subprocess
from functools import lru_cache

import psutil


def mlx_backend() -> str:
    """`metal`, `cuda` or `cpu`: where MLX's default device computes."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "cuda"
        return "gpu"
    return "cpu"


def _cpu_name() -> str:
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=5).stdout.strip()
        except OSError:
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_gpus() -> list[dict]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, capability, memory_mib = (part.strip() for part in line.split(","))
        gpus.append({"name": name, "compute_capability": capability,
                     "memory_bytes": int(float(memory_mib)) * 1024**2})
    return gpus


@lru_cache(maxsize=1)
def hardware_info() -> dict:
    """OS, CPU, memory, MLX backend/device and version (cached: it does not change)."""
    import mlx.core as mx

    backend = mlx_backend()
    device_info = dict(mx.device_info())
    gpu_name = None
    if backend == "metal":
        gpu_name = device_info.get("device_name") or device_info.get("architecture")
    gpus = _nvidia_gpus() if backend == "cuda" else []
    if gpus:
        gpu_name = gpus[0]["name"]
    return {
        "os": platform.system(),
        "os_release": platform.release(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": psutil.cpu_count(logical=True),
        "memory_bytes": psutil.virtual_memory().total,
        "mlx_version": mx.__version__,
        "backend": backend,
        "device": str(mx.default_device()),
        "gpu": gpu_name,
        "gpus": gpus,
        "device_info": {k: v for k, v in device_info.items() if isinstance(v, (str, int, float))},
    }


def hardware_fingerprint(info: dict | None = None) -> str:
    """Stable id of the parts that change kernel validity and tuning: not free memory."""
    info = info or hardware_info()
    keyed = {k: info[k] for k in ("os", "machine", "cpu", "cpu_count", "memory_bytes",
                                  "mlx_version", "backend", "gpu")}
    keyed["gpus"] = [(gpu["name"], gpu["compute_capability"]) for gpu in info.get("gpus", [])]
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
    return "hw-" + digest[:16]


def kernel_hardware(info: dict | None = None) -> dict:
    """What kernel validations match on: backend, GPU architecture and GPU name.

    CUDA: the architecture is `sm_<major><minor>` (from MLX's device info, else
    nvidia-smi's compute capability) and the name the GPU's. Metal: MLX's GPU family and
    device name (the Apple chip). Elsewhere both are None.
    """
    info = info or hardware_info()
    device = info.get("device_info", {})
    arch = None
    if info["backend"] == "cuda":
        arch = device.get("architecture")
        if not arch and info.get("gpus"):
            arch = "sm_" + info["gpus"][0]["compute_capability"].replace(".", "")
    elif info["backend"] == "metal":
        arch = device.get("architecture")
    gpu = (info.get("gpu") or device.get("device_name")) if info["backend"] in ("cuda", "metal") else None
    return {"backend": info["backend"], "arch": arch, "gpu": gpu}
