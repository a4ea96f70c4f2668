"""Accelerator detection and utilisation sampling, against a fake NVML and psutil and the real pynvml."""

import importlib
import importlib.util
from types import SimpleNamespace

import pytest

from worker_agent import gpu
from worker_agent.gpu import GpuMonitor, cuda_version_string, describe

GIB = 1024**3


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The part of pynvml the monitor uses, over a list of device dicts.

    ``failing`` holds ``(call, index)`` pairs whose NVML call raises, e.g. ``("utilization", 0)``.
    """

    NVMLError = FakeNVMLError
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, devices, *, init_error=None, driver=b"550.54.15", cuda=12040, failing=()):
        self.devices = devices
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.failing = set(failing)
        self.initialised = False
        self.shutdowns = 0

    def _check(self):
        if not self.initialised:
            raise FakeNVMLError("Uninitialized")

    def _device(self, call, handle):
        self._check()
        kind, index = handle
        assert kind == "handle"
        if (call, index) in self.failing:
            raise FakeNVMLError(f"{call} not supported")
        return self.devices[index]

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self):
        self._check()
        self.initialised = False
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        self._check()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check()
        if ("handle", index) in self.failing:
            raise FakeNVMLError("GPU is lost")
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return self._device("name", handle)["name"]

    def nvmlDeviceGetUUID(self, handle):
        return self._device("uuid", handle)["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        device = self._device("memory", handle)
        return SimpleNamespace(total=device["total"], used=device["used"], free=device["total"] - device["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        device = self._device("utilization", handle)
        return SimpleNamespace(gpu=device["util"], memory=device["util"] // 2)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._device("temperature", handle)["temp"]

    def nvmlSystemGetDriverVersion(self):
        self._check()
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self):
        self._check()
        return self.cuda


class FakePsutil:
    def __init__(self):
        self.cpu_intervals = []

    def cpu_percent(self, interval=0.1):
        self.cpu_intervals.append(interval)
        return 37.5

    def virtual_memory(self):
        return SimpleNamespace(percent=42.0, used=12 * GIB + GIB // 4, total=64 * GIB)


def a100(index, *, name=b"NVIDIA A100-SXM4-80GB", util=90, used=20 * GIB, temp=61):
    return {
        "name": name,
        "uuid": f"GPU-0000-{index}".encode(),
        "total": 80 * GIB,
        "used": used,
        "util": util,
        "temp": temp,
    }


def never_mps():
    return False


def always_mps():
    return True


def monitor_for(nvml, torch_probe=never_mps):
    return GpuMonitor(nvml=nvml, psutil_module=FakePsutil(), torch_probe=torch_probe)


@pytest.mark.parametrize("encode", [bytes, str], ids=["bytes", "str"])
def test_two_gpus_capabilities_carry_flat_nested_and_per_gpu_fields(encode):
    def text(value):
        return value if encode is bytes else value.decode()

    nvml = FakeNVML(
        [a100(0, name=text(b"NVIDIA A100-SXM4-80GB")), a100(1, name=text(b"NVIDIA A100-SXM4-80GB"))],
        driver=text(b"550.54.15"),
    )
    nvml.devices[0]["uuid"] = text(nvml.devices[0]["uuid"])
    nvml.devices[1]["uuid"] = text(nvml.devices[1]["uuid"])

    caps = monitor_for(nvml, torch_probe=always_mps).capabilities()

    assert caps == {
        "gpu_count": 2,
        "gpu_name": "NVIDIA A100-SXM4-80GB",
        "gpu_vram_gb": 80.0,
        "accelerator_type": "cuda",  # NVIDIA wins over MPS
        "driver_version": "550.54.15",
        "cuda_version": "12.4",
        "gpus": [
            {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-0000-0", "vram_gb": 80.0},
            {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-0000-1", "vram_gb": 80.0},
        ],
        "gpu_info": {
            "name": "NVIDIA A100-SXM4-80GB",
            "vram_gb": 80.0,
            "count": 2,
            "driver": "12.4",
            "accelerator": "cuda",
        },
    }
    assert isinstance(caps["gpu_vram_gb"], float)


def test_vram_is_rounded_gib_of_the_first_gpu():
    card = a100(0, name=b"NVIDIA GeForce RTX 4090")
    card["total"] = 25757220864  # what a 4090 reports: 23.99 GiB
    small = a100(1, name=b"NVIDIA T4")
    small["total"] = 15 * GIB + GIB // 3
    caps = monitor_for(FakeNVML([card, small])).capabilities()
    assert caps["gpu_vram_gb"] == 24.0
    assert [g["vram_gb"] for g in caps["gpus"]] == [24.0, 15.3]
    assert caps["gpu_name"] == "NVIDIA GeForce RTX 4090"


def test_two_gpus_sample_reports_each_gpu_and_the_host():
    nvml = FakeNVML([a100(0, util=90, used=20 * GIB, temp=61), a100(1, util=15, used=GIB + GIB // 2, temp=48)])
    psutil = FakePsutil()
    monitor = GpuMonitor(nvml=nvml, psutil_module=psutil, torch_probe=never_mps)

    sample = monitor.sample()

    assert sample["gpu_utilization"] == [90, 15]
    assert sample["gpu_memory_used_gb"] == [20.0, 1.5]
    assert sample["gpu_memory_total_gb"] == [80.0, 80.0]
    assert sample["gpus"] == [
        {"index": 0, "utilization": 90, "memory_used_gb": 20.0, "memory_total_gb": 80.0, "temperature_c": 61},
        {"index": 1, "utilization": 15, "memory_used_gb": 1.5, "memory_total_gb": 80.0, "temperature_c": 48},
    ]
    assert sample["cpu_percent"] == 37.5
    assert psutil.cpu_intervals and set(psutil.cpu_intervals) == {None}  # never blocks the heartbeat
    assert sample["memory_percent"] == 42.0
    assert sample["memory_used_gb"] == 12.25
    assert len(sample["load_average"]) == 3 and all(isinstance(v, float) for v in sample["load_average"])
    # exactly the metrics the orchestrator stores from a heartbeat (the contract between the two)
    from worker_agent.protocol import HEARTBEAT_METRIC_FIELDS

    assert set(sample) == set(HEARTBEAT_METRIC_FIELDS)


def test_one_gpus_failing_calls_do_not_spoil_the_sample():
    nvml = FakeNVML(
        [a100(0, util=90), a100(1, util=55, used=4 * GIB, temp=50)],
        failing={("utilization", 0), ("temperature", 1)},
    )
    sample = monitor_for(nvml).sample()
    assert sample["gpu_utilization"] == [None, 55]
    assert sample["gpu_memory_used_gb"] == [20.0, 4.0]
    assert sample["gpus"][0] == {
        "index": 0,
        "utilization": None,
        "memory_used_gb": 20.0,
        "memory_total_gb": 80.0,
        "temperature_c": 61,
    }
    assert sample["gpus"][1]["temperature_c"] is None
    assert sample["gpus"][1]["utilization"] == 55


def test_a_lost_gpu_is_still_counted_with_what_is_unknown_left_empty():
    nvml = FakeNVML([a100(0), a100(1)], failing={("handle", 1), ("memory", 0)})
    monitor = monitor_for(nvml)
    caps = monitor.capabilities()
    assert caps["gpu_count"] == 2
    assert caps["gpus"][1] == {"index": 1, "name": "", "uuid": None, "vram_gb": None}
    assert caps["gpu_vram_gb"] is None  # the first GPU's memory call failed
    assert caps["gpu_name"] == "NVIDIA A100-SXM4-80GB"
    sample = monitor.sample()
    assert sample["gpus"][1] == {
        "index": 1,
        "utilization": None,
        "memory_used_gb": None,
        "memory_total_gb": None,
        "temperature_c": None,
    }
    assert sample["gpu_utilization"] == [90, None]


@pytest.mark.parametrize(
    "error", [FakeNVMLError("NVML Shared Library Not Found"), OSError("libnvidia-ml.so.1: cannot open")]
)
def test_no_driver_means_cpu_and_nothing_raises(error):
    nvml = FakeNVML([a100(0)], init_error=error)
    monitor = monitor_for(nvml)

    caps = monitor.capabilities()
    sample = monitor.sample()
    monitor.close()

    assert not monitor.nvml_available
    assert caps == {
        "gpu_count": 0,
        "gpu_name": "",
        "gpu_vram_gb": None,
        "accelerator_type": "cpu",
        "driver_version": None,
        "cuda_version": None,
        "gpus": [],
        "gpu_info": {"name": "", "vram_gb": None, "count": 0, "driver": None, "accelerator": None},
    }
    assert sample["gpu_utilization"] == sample["gpu_memory_used_gb"] == sample["gpus"] == []
    assert sample["cpu_percent"] == 37.5
    assert nvml.shutdowns == 0


def test_a_driver_with_no_devices_is_cpu():
    nvml = FakeNVML([])
    monitor = monitor_for(nvml)
    caps = monitor.capabilities()
    assert caps["gpu_count"] == 0
    assert caps["accelerator_type"] == "cpu"
    assert caps["gpu_info"]["accelerator"] is None
    assert caps["driver_version"] == "550.54.15"  # the driver is there, just no device
    assert monitor.sample()["gpu_utilization"] == []


def test_mps_when_no_nvidia_gpu_and_the_probe_says_so():
    caps = monitor_for(FakeNVML([], init_error=FakeNVMLError("no driver")), torch_probe=always_mps).capabilities()
    assert caps["accelerator_type"] == "mps"
    assert caps["gpu_count"] == 0
    assert caps["gpu_info"]["accelerator"] == "mps"


def test_a_probe_that_raises_means_not_mps():
    def broken():
        raise RuntimeError("torch exploded")

    caps = monitor_for(FakeNVML([], init_error=FakeNVMLError("no driver")), torch_probe=broken).capabilities()
    assert caps["accelerator_type"] == "cpu"


def test_cuda_version_falls_back_to_the_v1_call():
    class OldNVML(FakeNVML):
        """Bindings from before the _v2 call: the attribute is absent."""

        def __getattribute__(self, name):
            if name == "nvmlSystemGetCudaDriverVersion_v2":
                raise AttributeError(name)
            return super().__getattribute__(name)

        def nvmlSystemGetCudaDriverVersion(self):
            return 11080

    class NoV2(FakeNVML):
        def nvmlSystemGetCudaDriverVersion_v2(self):
            raise FakeNVMLError("Function Not Found")

        def nvmlSystemGetCudaDriverVersion(self):
            return 12020

    assert monitor_for(OldNVML([a100(0)])).capabilities()["cuda_version"] == "11.8"
    assert monitor_for(NoV2([a100(0)])).capabilities()["cuda_version"] == "12.2"


@pytest.mark.parametrize("raw, text", [(12040, "12.4"), (11080, "11.8"), (12020, "12.2"), (13000, "13.0")])
def test_cuda_version_string(raw, text):
    assert cuda_version_string(raw) == text


def test_close_shuts_nvml_down_once():
    nvml = FakeNVML([a100(0)])
    monitor = monitor_for(nvml)
    assert monitor.nvml_available
    monitor.close()
    monitor.close()
    assert nvml.shutdowns == 1
    assert monitor.capabilities()["gpu_count"] == 0  # after close it no longer touches NVML
    with monitor_for(FakeNVML([a100(0)])) as other:
        assert other.capabilities()["gpu_count"] == 1
    assert not other.nvml_available


def test_describe_lines():
    two = monitor_for(FakeNVML([a100(0), a100(1)], driver=b"550.54")).capabilities()
    assert describe(two) == "2 × NVIDIA A100-SXM4-80GB (80.0 GB), driver 550.54, CUDA 12.4"

    mixed = monitor_for(FakeNVML([a100(0), a100(1, name=b"NVIDIA H100 80GB HBM3")], cuda=0)).capabilities()
    assert describe(mixed) == "NVIDIA A100-SXM4-80GB (80.0 GB) + NVIDIA H100 80GB HBM3 (80.0 GB), driver 550.54.15"

    assert describe(monitor_for(FakeNVML([]), torch_probe=always_mps).capabilities()) == "Apple MPS"
    assert describe(monitor_for(FakeNVML([])).capabilities()) == "no NVIDIA GPU (cpu)"


def test_the_mps_probe_imports_torch_only_when_installed(monkeypatch):
    imported = []

    def fake_import(name):
        imported.append(name)
        mps = SimpleNamespace(is_available=lambda: True)
        return SimpleNamespace(backends=SimpleNamespace(mps=mps))

    monkeypatch.setattr(importlib, "import_module", fake_import)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert gpu.mps_available() is False
    assert imported == []

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(name=name))
    assert gpu.mps_available() is True
    assert imported == ["torch"]

    def broken_import(name):
        raise ImportError("libtorch_cpu.so: cannot open shared object file")

    monkeypatch.setattr(importlib, "import_module", broken_import)
    assert gpu.mps_available() is False


def test_the_real_pynvml_and_psutil_work_on_this_machine():
    import pynvml

    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError):
        has_driver = False
    else:
        has_driver = True
        device_count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()

    monitor = GpuMonitor()
    try:
        caps = monitor.capabilities()
        sample = monitor.sample()
    finally:
        monitor.close()

    assert monitor.nvml_available is False
    if has_driver:
        assert caps["gpu_count"] == device_count
        assert caps["accelerator_type"] in (("cuda",) if device_count else ("cpu", "mps"))
        assert len(sample["gpus"]) == device_count
    else:
        assert caps["gpu_count"] == 0
        assert caps["accelerator_type"] in ("cpu", "mps")
        assert caps["gpus"] == [] and sample["gpus"] == []
        assert caps["driver_version"] is None
    assert 0.0 <= sample["cpu_percent"] <= 100.0 * 1024
    assert 0.0 < sample["memory_percent"] < 100.0
    assert sample["memory_used_gb"] > 0
    assert isinstance(describe(caps), str) and describe(caps)


# --- --gpus: restricting the monitor, or declaring GPU slots ----------------------------------------


def test_gpus_restrict_capabilities_samples_and_slots_to_those_nvml_sees():
    cards = [a100(0, util=10), a100(1, util=20), a100(2, util=30), a100(3, util=40)]
    monitor = monitor_for(FakeNVML(cards))
    assert monitor.slots() == ([0, 1, 2, 3], False)  # by default: every GPU NVML sees
    monitor.use_gpus([3, 1])
    caps = monitor.capabilities()
    assert caps["gpu_count"] == 2 and caps["gpu_info"]["count"] == 2
    assert [gpu["index"] for gpu in caps["gpus"]] == [1, 3] and caps["accelerator_type"] == "cuda"
    sample = monitor.sample()
    assert [gpu["index"] for gpu in sample["gpus"]] == [1, 3] and sample["gpu_utilization"] == [20, 40]
    assert monitor.slots() == ([1, 3], False)


def test_gpus_naming_a_gpu_nvml_does_not_see_is_refused():
    monitor = monitor_for(FakeNVML([a100(0), a100(1)]))
    with pytest.raises(ValueError) as caught:
        monitor.use_gpus([1, 2, 5])
    assert str(caught.value) == "--gpus names GPU 2, 5, which NVML does not see (it sees 0, 1)"
    assert monitor.slots() == ([0, 1], False)  # unchanged


@pytest.mark.parametrize("nvml", [FakeNVML([]), FakeNVML([], init_error=FakeNVMLError("no driver"))], ids=["no-device", "no-driver"])
def test_gpus_without_nvml_gpus_declare_slots_never_reported_as_nvidia(nvml):
    monitor = monitor_for(nvml)
    monitor.use_gpus([0, 1, 2, 3])
    caps = monitor.capabilities()
    assert caps["gpu_count"] == 4 and caps["gpu_info"]["count"] == 4
    assert caps["gpus"] == [] and caps["gpu_name"] == "" and caps["gpu_vram_gb"] is None
    assert caps["accelerator_type"] == "cpu" and caps["gpu_info"]["accelerator"] is None
    assert monitor.slots() == ([0, 1, 2, 3], True)
    assert monitor.sample()["gpus"] == []
