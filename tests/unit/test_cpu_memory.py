"""engine.cpu_memory: a CPU worker keeps freed blocks in its heap (glibc's thresholds), unless turned off."""

from __future__ import annotations

import os
import subprocess
import sys

from vllm_dsbd.engine import cpu_memory

# A fresh process mallocs 16 MiB, then frees it: is the block in the heap (below the program break) and is
# the heap left as it was after the free (not trimmed)?
PROBE = """
import ctypes, ctypes.util, sys
from vllm_dsbd.engine import cpu_memory
applied = cpu_memory.keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_void_p], [ctypes.c_long]
block = libc.malloc(16 << 20)
ctypes.memset(block, 1, 16 << 20)
in_heap = block < libc.sbrk(0)
brk = libc.sbrk(0)
libc.free(block)
print(applied, in_heap, libc.sbrk(0) == brk)
"""


def probe(env_value: str | None) -> str:
    env = {} if env_value is None else {cpu_memory.ENV: env_value}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_a_worker_keeps_freed_blocks_in_its_heap_unless_turned_off():
    assert probe(None) == "True True True"  # a 16 MiB block from the heap, kept there after its free
    assert probe("0") == "False False True"  # glibc's default: a block that large is mmapped
