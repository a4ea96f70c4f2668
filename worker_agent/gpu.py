"""What accelerators this node has (NVML, Apple MPS or none) and how busy they and the host are."""

import importlib
import importlib.util
import logging
import os
import threading

logger = logging.getLogger(__name__)

_GIB = 1024**3


def _text(value):
    """Return ``value`` as ``str`` (pynvml gives ``bytes`` or ``str`` depending on its version)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _gib(n_bytes, digits):
    """Return a byte count in GiB, rounded to ``digits`` decimals."""
    return round(n_bytes / _GIB, digits)


def cuda_version_string(version):
    """Return NVML's integer CUDA version as text: 12040 -> "12.4", 11080 -> "11.8"."""
    version = int(version)
    return f"{version // 1000}.{(version % 1000) // 10}"


def mps_available():
    """Return True if PyTorch is installed and reports Apple's Metal (MPS) backend as usable.

    Torch is imported only when it is installed; any error while asking it means "no MPS".
    """
    try:
        if importlib.util.find_spec("torch") is None:
            return False
        torch = importlib.import_module("torch")
        return bool(torch.backends.mps.is_available())
    except Exception as exc:
        logger.debug("MPS probe failed: %s", exc)
        return False


class GpuMonitor:
    """Reports this node's accelerators for registration and their utilisation for heartbeats.

    ``nvml`` is the ``pynvml`` module (or a stand-in with the same functions), ``psutil_module``
    the ``psutil`` module and ``torch_probe`` a callable answering "is Apple MPS usable?". Without an
    NVIDIA driver the monitor works in "no NVIDIA" mode: it reports no GPUs and never raises.

    ``use_gpus(indices)`` (``--gpus``) restricts it to those GPUs where NVML sees GPUs, and declares that
    many GPU slots where it sees none (``slots()``).
    """

    def __init__(self, nvml=None, psutil_module=None, torch_probe=None):
        self._lock = threading.Lock()
        self._nvml = None
        self._nvml_errors = (OSError,)
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                logger.info("pynvml is not installed (%s); reporting no NVIDIA GPU", exc)
        if nvml is not None:
            errors = (getattr(nvml, "NVMLError", OSError), OSError)
            try:
                nvml.nvmlInit()
            except errors as exc:
                logger.info("NVML unavailable (%s); reporting no NVIDIA GPU", exc)
            else:
                self._nvml = nvml
                self._nvml_errors = errors
        if psutil_module is None:
            import psutil as psutil_module
        self._psutil = psutil_module
        self._torch_probe = torch_probe if torch_probe is not None else mps_available
        self._only = None  # the NVML indices --gpus restricts the monitor to (None: every GPU NVML sees)
        self._declared = None  # the GPU slots --gpus declares where NVML sees no GPU
        # The first cpu_percent(interval=None) measures from process start; prime it so the first
        # heartbeat reports the interval since the monitor was made.
        self._psutil.cpu_percent(interval=None)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    @property
    def nvml_available(self):
        """True while NVML is initialised (an NVIDIA driver answered)."""
        return self._nvml is not None

    def close(self):
        """Shut NVML down if this monitor initialised it; safe to call more than once."""
        with self._lock:
            nvml, self._nvml = self._nvml, None
            if nvml is None:
                return
            try:
                nvml.nvmlShutdown()
            except self._nvml_errors as exc:
                logger.debug("nvmlShutdown failed: %s", exc)

    def use_gpus(self, indices):
        """Use only the GPUs ``indices`` (``--gpus``): where NVML sees GPUs, capabilities and samples cover those
        alone; where it sees none, they are declared GPU slots (``slots()``), never reported as NVIDIA GPUs.
        Raise ValueError naming an index NVML does not see."""
        indices = [int(index) for index in indices]
        with self._lock:
            seen = [index for index, _ in self._handles()]
            if not seen:
                self._declared = indices
                return
            missing = [index for index in indices if index not in seen]
            if missing:
                raise ValueError(
                    f"--gpus names GPU {', '.join(map(str, missing))}, which NVML does not see "
                    f"(it sees {', '.join(map(str, seen))})"
                )
            self._only = set(indices)

    def slots(self):
        """Return ``(indices, declared)``: the GPU indices jobs may be given (the GPUs NVML sees, restricted by
        ``use_gpus``, or the declared ones) and whether they are declared (no NVIDIA GPU backs them)."""
        if self._declared is not None:
            return list(self._declared), True
        with self._lock:
            return [index for index, _ in self._handles()], False

    def _call(self, what, function, *args):
        """Return ``function(*args)``, or None (logged at debug) if NVML raises."""
        try:
            return function(*args)
        except self._nvml_errors as exc:
            logger.debug("NVML %s failed: %s", what, exc)
            return None

    def _handles(self):
        """Return ``[(index, handle or None)]`` for every device NVML counts; [] without NVML."""
        nvml = self._nvml
        if nvml is None:
            return []
        count = self._call("device count", nvml.nvmlDeviceGetCount) or 0
        return [
            (index, self._call(f"handle of GPU {index}", nvml.nvmlDeviceGetHandleByIndex, index))
            for index in range(count)
            if self._only is None or index in self._only
        ]

    def _cuda_version(self):
        nvml = self._nvml
        for name in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
            function = getattr(nvml, name, None)
            if function is None:
                continue
            version = self._call(name, function)
            if version:
                return cuda_version_string(version)
        return None

    def capabilities(self):
        """Return what this node offers, as the agent sends it when it registers.

        Keys: ``gpu_count``, ``gpu_name``, ``gpu_vram_gb`` (GiB of the first GPU, 1 decimal),
        ``accelerator_type`` ("cuda", "mps" or "cpu"), ``driver_version``, ``cuda_version``,
        ``gpus`` (one ``{"index", "name", "uuid", "vram_gb"}`` per device) and ``gpu_info``, the
        nested form the upstream agent sends (``driver`` there is the CUDA version). Declared GPU slots
        (``use_gpus`` without NVML GPUs) count in ``gpu_count`` alone: no name, no per-GPU entry, not "cuda".
        """
        with self._lock:
            nvml = self._nvml
            gpus = []
            driver_version = cuda_version = None
            for index, handle in self._handles():
                name = uuid = vram_gb = None
                if handle is not None:
                    name = self._call(f"name of GPU {index}", nvml.nvmlDeviceGetName, handle)
                    uuid = self._call(f"UUID of GPU {index}", nvml.nvmlDeviceGetUUID, handle)
                    memory = self._call(f"memory of GPU {index}", nvml.nvmlDeviceGetMemoryInfo, handle)
                    vram_gb = _gib(memory.total, 1) if memory is not None else None
                gpus.append(
                    {
                        "index": index,
                        "name": _text(name) if name is not None else "",
                        "uuid": _text(uuid) if uuid is not None else None,
                        "vram_gb": vram_gb,
                    }
                )
            if nvml is not None:
                driver = self._call("driver version", nvml.nvmlSystemGetDriverVersion)
                driver_version = _text(driver) if driver is not None else None
                cuda_version = self._cuda_version()
        if gpus:
            accelerator = "cuda"
        elif self._probe_mps():
            accelerator = "mps"
        else:
            accelerator = "cpu"
        first = gpus[0] if gpus else {"name": "", "vram_gb": None}
        count = len(self._declared) if self._declared is not None else len(gpus)
        return {
            "gpu_count": count,
            "gpu_name": first["name"],
            "gpu_vram_gb": first["vram_gb"],
            "accelerator_type": accelerator,
            "driver_version": driver_version,
            "cuda_version": cuda_version,
            "gpus": gpus,
            "gpu_info": {
                "name": first["name"],
                "vram_gb": first["vram_gb"],
                "count": count,
                "driver": cuda_version,
                "accelerator": None if accelerator == "cpu" else accelerator,
            },
        }

    def _probe_mps(self):
        try:
            return bool(self._torch_probe())
        except Exception as exc:
            logger.debug("MPS probe failed: %s", exc)
            return False

    def sample(self):
        """Return the utilisation figures a heartbeat carries: one value per ``protocol.HEARTBEAT_METRIC_FIELDS``.

        Per GPU (lists in device order, None where that GPU's reading failed): ``gpu_utilization``
        (%), ``gpu_memory_used_gb``, ``gpu_memory_total_gb`` and ``gpus`` (``{"index",
        "utilization", "memory_used_gb", "memory_total_gb", "temperature_c"}``). Host:
        ``cpu_percent`` (since the previous sample), ``memory_percent``, ``memory_used_gb`` and
        ``load_average`` (1, 5, 15 minutes; None where the platform has none).
        """
        with self._lock:
            nvml = self._nvml
            gpus = []
            for index, handle in self._handles():
                utilization = used_gb = total_gb = temperature = None
                if handle is not None:
                    rates = self._call(f"utilisation of GPU {index}", nvml.nvmlDeviceGetUtilizationRates, handle)
                    memory = self._call(f"memory of GPU {index}", nvml.nvmlDeviceGetMemoryInfo, handle)
                    temperature = self._call(
                        f"temperature of GPU {index}", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
                    )
                    if rates is not None:
                        utilization = int(rates.gpu)
                    if memory is not None:
                        used_gb, total_gb = _gib(memory.used, 2), _gib(memory.total, 2)
                gpus.append(
                    {
                        "index": index,
                        "utilization": utilization,
                        "memory_used_gb": used_gb,
                        "memory_total_gb": total_gb,
                        "temperature_c": int(temperature) if temperature is not None else None,
                    }
                )
        memory = self._psutil.virtual_memory()
        try:
            load_average = [round(value, 2) for value in os.getloadavg()]
        except (AttributeError, OSError):
            load_average = None
        return {
            "gpu_utilization": [gpu["utilization"] for gpu in gpus],
            "gpu_memory_used_gb": [gpu["memory_used_gb"] for gpu in gpus],
            "gpu_memory_total_gb": [gpu["memory_total_gb"] for gpu in gpus],
            "gpus": gpus,
            "cpu_percent": self._psutil.cpu_percent(interval=None),
            "memory_percent": memory.percent,
            "memory_used_gb": _gib(memory.used, 2),
            "load_average": load_average,
        }


def describe(caps):
    """Return one human line for the console from a ``capabilities()`` dict.

    E.g. "2 × NVIDIA A100-SXM4-80GB (80.0 GB), driver 550.54, CUDA 12.4", "Apple MPS" or
    "no NVIDIA GPU (cpu)".
    """
    gpus = caps.get("gpus") or []
    if caps.get("accelerator_type") == "cuda" and gpus:
        models = {(gpu.get("name"), gpu.get("vram_gb")) for gpu in gpus}
        if len(models) == 1:
            line = f"{len(gpus)} × {_gpu_label(gpus[0])}"
        else:
            line = " + ".join(_gpu_label(gpu) for gpu in gpus)
        if caps.get("driver_version"):
            line += f", driver {caps['driver_version']}"
        if caps.get("cuda_version"):
            line += f", CUDA {caps['cuda_version']}"
        return line
    if caps.get("accelerator_type") == "mps":
        return "Apple MPS"
    return "no NVIDIA GPU (cpu)"


def _gpu_label(gpu):
    label = gpu.get("name") or "unknown GPU"
    if gpu.get("vram_gb") is not None:
        label += f" ({gpu['vram_gb']:.1f} GB)"
    return label
