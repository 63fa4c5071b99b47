"""Keep freed memory in a CPU worker's heap instead of handing it back to the kernel.

A DSBD decision on CPU allocates buffers of ``W x V`` floats and more (a verification's residual ladder,
[W + 1, G, W x V]; the tempered log-probs of every forest node), frees them, and allocates them again the
next step. glibc serves blocks above its mmap threshold with fresh ``mmap`` pages and trims the top of its
heap when a large block there is freed, so each step's buffers page-fault anew: in the default pair's verify
step (γ 2, W 4, V 49,152, in-process engine, AMD EPYC) a ``torch.sub`` over one ladder level took 0.36 ms
against 0.02 ms with the memory kept, and the runner's decisions 15 ms a step against 7.9 ms
(docs/dev/history.md; about a third less in the two-process engine).

:func:`keep_freed_memory` raises glibc's mmap threshold to its maximum (32 MiB) and its trim threshold to the
largest value ``mallopt`` takes, in the calling process (the worker: ``DSBDCPUModelRunner``), so freed blocks
are reused. The cost: the worker's resident memory stays at its high-water mark for blocks below 32 MiB.
``VLLM_DSBD_KEEP_FREED_MEMORY=0`` turns it off. Nothing is done where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV = "VLLM_DSBD_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (module docstring); True if set, False if turned off or not glibc."""
    if os.environ.get(ENV, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                        TRIM_THRESHOLD))
