"""The GPU's copy engines, asked for strided host -> device copies through the CUDA runtime that
torch already loaded (CUDA only).

torch copies one contiguous range per call; a layer of the host tier's slots is a strided range
(one K/V pair every slot), which `cudaMemcpy2DAsync` moves in one call on a DMA engine, leaving
every SM to the prefill the load runs beside. The binding reuses the process's own runtime
library (found among its mapped files), so torch's streams are valid handles for it; where that
library cannot be found (a statically linked runtime, a CPU build) `CopyEngine.find` returns
None and the caller keeps its kernel.
"""

from __future__ import annotations

import ctypes
import os

import torch

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


class CopyEngine:
    """`cudaMemcpy2DAsync` of the loaded CUDA runtime.

    Invariants: only copies from host to device are issued; every call's error code is checked."""

    def __init__(self, runtime: ctypes.CDLL) -> None:
        fn = runtime.cudaMemcpy2DAsync
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
        ]  # fmt: skip
        self._memcpy_2d = fn

    @staticmethod
    def find() -> CopyEngine | None:
        """The copy engine of the runtime torch uses, or None (no CUDA, or no separate runtime
        library mapped in this process)."""
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()
        path = _mapped_runtime()
        if path is None:
            return None
        try:
            return CopyEngine(ctypes.CDLL(path))
        except (OSError, AttributeError):
            return None

    def host_to_device_2d(
        self,
        dst_ptr: int,
        dst_pitch: int,
        src_ptr: int,
        src_pitch: int,
        row_bytes: int,
        num_rows: int,
        stream: torch.cuda.Stream,
    ) -> None:
        """Queue `num_rows` rows of `row_bytes` from pinned host memory (rows `src_pitch` apart)
        to the device (rows `dst_pitch` apart) on `stream`."""
        if row_bytes > min(dst_pitch, src_pitch) or num_rows <= 0:
            raise ValueError(
                f"{num_rows} rows of {row_bytes} bytes do not fit pitches {src_pitch} -> "
                f"{dst_pitch}"
            )
        err = self._memcpy_2d(
            dst_ptr, dst_pitch, src_ptr, src_pitch, row_bytes, num_rows, _HOST_TO_DEVICE,
            stream.cuda_stream,
        )  # fmt: skip
        if err != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")


def _mapped_runtime() -> str | None:
    """The path of the CUDA runtime library mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libcudart.so"):
                    return path
    except OSError:
        return None
    return None
