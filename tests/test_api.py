"""The package surface: __all__ is sorted and complete, and nothing touches CUDA on import."""

from __future__ import annotations

import subprocess
import sys

import sharedmem as sm


def test_all_is_sorted_and_every_name_exists() -> None:
    assert sm.__all__ == sorted(sm.__all__)
    for name in sm.__all__:
        assert hasattr(sm, name), name


def test_every_public_object_is_listed() -> None:
    module = type(sm)
    public = {n for n, v in vars(sm).items() if not n.startswith("_") and not isinstance(v, module)}
    assert public - {"annotations"} == set(sm.__all__) - {"__version__"}


def test_available_devices_starts_with_the_ones_that_always_work() -> None:
    devices = sm.available_devices()
    assert devices[:2] == ["cpu", "emulated"]
    assert all(d.startswith("cuda:") for d in devices[2:])


def test_backend_names_put_the_default_first() -> None:
    assert sm.backend_names("cpu") == ("reserved", "pageable")
    assert sm.backend_names("emulated") == ("reserved", "pageable")
    assert sm.backend_names("cuda:0") == ("vmm", "cudart", "torch")


def test_import_and_cpu_use_never_initialize_cuda() -> None:
    code = (
        "import sys, sharedmem as sm, torch\n"
        "m = sm.SyncedMemory(64, device='emulated'); m.mutable_device_data(); m.host_data()\n"
        "b = sm.Blob((4,), device='cpu'); b.mutable_data()\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'sharedmem._backends.cuda' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
