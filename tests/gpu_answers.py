"""What a real GPU answers where the CUDA stand-in (tests/cudasim) can only guess.

``./dev gpu-check`` runs this on a machine with a GPU and puts its lines in the report; compare
them with the stand-in's choices (named in each line) and change the stand-in where they
differ. Without a GPU it says so and exits with status 2.

    python tests/gpu_answers.py
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any


def _say(question: str, answer: object, stand_in: str) -> None:
    print(f"{question}: {answer}   [the stand-in: {stand_in}]", flush=True)


def _ask(question: str, stand_in: str, how: Callable[[], object]) -> None:
    try:
        answer = how()
    except Exception as error:  # an answer too: report it and go on
        answer = f"raised {type(error).__name__}: {error}"
    _say(question, answer, stand_in)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_answers: no CUDA GPU here; nothing to ask", file=sys.stderr)
        return 2
    from cuda.bindings import driver

    from sharedmem._backends import cuda_api
    from sharedmem._backends.cuda_vmm import allocation_prop

    torch.cuda.init()
    count = torch.cuda.device_count()
    flags = driver.CUmemAllocationGranularity_flags

    with cuda_api.on_device(0):
        prop = allocation_prop(0)
        _ask(
            "granularity (minimum, recommended)",
            "65,536 and 2,097,152",
            lambda: tuple(
                driver.cuMemGetAllocationGranularity(prop, f)[1]
                for f in (
                    flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                    flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            ),
        )
        for size in (1 << 50, 1 << 60):
            _ask(
                f"cuMemAddressReserve({size:,}) (an impossible size)",
                "CUDA_ERROR_INVALID_VALUE by default; either code is handled",
                lambda size=size: driver.cuMemAddressReserve(size, 0, 0, 0)[0].name,
            )
        _ask("fresh cudaMalloc memory (first 16 bytes)", "0xa5 bytes", _fresh_cuda_malloc)
        _ask(
            "cuDeviceCanAccessPeer for each pair",
            "1 for every pair of different devices",
            lambda: {
                (a, b): driver.cuDeviceCanAccessPeer(a, b)[1]
                for a in range(count)
                for b in range(count)
                if a != b
            },
        )
    _ask(
        "a global capture on another thread: this thread's cuMemCreate, the capture after",
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, invalidated",
        lambda: _capture_elsewhere(lambda: driver.cuMemCreate(2 << 20, prop, 0)[0].name),
    )
    _ask(
        "a global capture on another thread: is_current_stream_capturing() here",
        "sharedmem sees that capture (the stand-in says True)",
        lambda: _capture_elsewhere(torch.cuda.is_current_stream_capturing),
    )
    _ask(
        "growing a sharedmem buffer while this thread captures",
        "a SharedMemError that says to grow before capturing",
        _grow_in_capture,
    )
    return 0


def _fresh_cuda_malloc() -> str:
    import torch

    tensor = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # not cleared
    return tensor[:16].cpu().numpy().tobytes().hex()


def _capture_elsewhere(probe: Callable[[], object]) -> tuple[object, str]:
    """Run ``probe`` here while another thread captures in global mode."""
    import torch

    started, probed = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def capture() -> None:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin()
                started.set()
                probed.wait()
                graph.capture_end()
            result["capture"] = "survived"
        except Exception as error:
            result["capture"] = f"broken ({type(error).__name__}: {error})"
            started.set()

    thread = threading.Thread(target=capture)
    thread.start()
    started.wait()
    try:
        answer = probe()
    finally:
        probed.set()
        thread.join()
    return answer, result.get("capture", "?")


def _grow_in_capture() -> str:
    import torch

    import sharedmem as sm

    memory = sm.SyncedMemory(1000, device="cuda")
    memory.mutable_device_data()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    memory.set_size(64 << 20)
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            memory.mutable_device_data()
            answer = "grew (no error)"
        except sm.SharedMemError as error:
            answer = str(error)
        finally:
            graph.capture_end()
    return answer


if __name__ == "__main__":
    sys.exit(main())
