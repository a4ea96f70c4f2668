"""What a registering agent says of its machine, read into ``Worker`` fields: the spec's flat fields and the upstream
agent's ``gpu_info`` alike (``docs/api.md``), each number bounded, each text cleaned and cut."""

import math

from common.errors import InvalidInput
from common.inputs import GPU_COUNT_MAX, GPU_VRAM_GB_MAX, clean_text


def _number(value, field, *, maximum, integer=False, minimum=0):
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidInput(f"{field} must be a number from {minimum} to {maximum}", code="invalid_capabilities") from None
    if not math.isfinite(number) or not minimum <= number <= maximum:
        raise InvalidInput(f"{field} must be a number from {minimum} to {maximum}", code="invalid_capabilities")
    return int(number) if integer else number


def parse_capabilities(data):
    """Return Worker fields from a register body, accepting the spec's flat fields and upstream ``gpu_info``."""
    gpu_info = data.get("gpu_info")
    if gpu_info is not None and not isinstance(gpu_info, dict):
        raise InvalidInput("gpu_info must be an object", code="invalid_capabilities")
    gpu_info = gpu_info or {}

    def pick(flat, nested):
        value = data.get(flat)
        return (gpu_info.get(nested), f"gpu_info.{nested}") if value is None else (value, flat)

    count = _number(*pick("gpu_count", "count"), maximum=GPU_COUNT_MAX, integer=True)
    vram = _number(*pick("gpu_vram_gb", "vram_gb"), maximum=GPU_VRAM_GB_MAX)
    name = pick("gpu_name", "name")[0]
    accelerator = pick("accelerator_type", "accelerator")[0]
    raw = dict(gpu_info)
    for key in ("gpu_count", "gpu_name", "gpu_vram_gb", "accelerator_type", "gpus", "driver_version", "cuda_version"):
        if data.get(key) is not None:
            raw[key] = data[key]
    return {
        "gpu_count": count or 0,
        "gpu_name": str(name or "")[:200],
        "gpu_vram_gb": vram,
        "accelerator_type": str(accelerator or ("cuda" if count else "cpu"))[:32],
        "gpu_info": raw,
        "hostname": str(data.get("hostname") or "")[:255],
        "agent_version": str(data.get("agent_version") or data.get("version") or "")[:64],
        "agent_name": clean_text(str(data.get("name") or ""))[:128],
        "agent_persistent": data.get("persistent") if isinstance(data.get("persistent"), bool) else None,
    }
