"""Patches 6-7: beam requests validated and tagged before they are queued; greedy n > 1 allowed for them."""

from __future__ import annotations

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine.upstream import original as _original
from vllm_dsbd.engine.upstream import wrapped as _wrapped


# ---------------------------------------------------------------------------
# Patch 6 — beam requests are validated and tagged before they are queued.
#   target:  vllm.v1.engine.input_processor.InputProcessor.process_inputs
#   why:     a bad beam request must fail with a clear error for that
#            request only (ValueError -> HTTP 400), not inside the engine; and
#            the scheduler must learn a group's size n (vLLM fans n > 1 out
#            into n engine requests) and the tokenizer's EOS id.
#   how:     on a DSBD engine, validate the user's SamplingParams of a beam
#            request (engine.requests.validate) and refuse a plain request
#            whose extra_args name a near-miss of a DSBD knob; on an engine
#            whose decoder is "mjsd" a plain request becomes an MJSD request
#            (engine.requests.as_mjsd_request)
#            (engine.requests.check_knob_typos), run the original, then add
#            the private extra_args key engine.requests.GROUP_TAG to the
#            request's (cloned) params.
#   remove-when: vLLM grows beam groups of its own.
# ---------------------------------------------------------------------------
def _validate_beam_requests() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_dsbd.engine import requests as beam_requests

    original = _original(InputProcessor, "process_inputs")

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        engine = DSBDConfig.from_vllm_config(self.vllm_config)
        beam = isinstance(params, SamplingParams) and beam_requests.is_beam_request(params)
        if engine is not None and isinstance(params, SamplingParams) and not beam:
            beam_requests.check_knob_typos(params.extra_args)  # {"beam_widht": 4} is no plain request
        if engine is not None and engine.mjsd and isinstance(params, SamplingParams) and not beam:
            params = beam_requests.as_mjsd_request(params)  # an MJSD engine decodes plain requests by MJSD
            beam = True
        if beam and engine is None:
            if params.n > 1 and params.temperature < 1e-5:
                _original(SamplingParams, "_verify_greedy_sampling")(params)  # vLLM's own error
            beam = False  # DSBD knobs mean nothing to other engines, as before the plugin
        if beam:
            config = beam_requests.validate(params, engine)
            beam_requests.check_capacity(config, self.vllm_config.scheduler_config.max_num_seqs)
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if beam:
            sp = request.sampling_params
            tag = {"n": sp.n, "eos": self.renderer.get_eos_token_id()}
            sp.extra_args = {**(sp.extra_args or {}), beam_requests.GROUP_TAG: tag}
        return request

    InputProcessor.process_inputs = _wrapped(original, process_inputs)


# ---------------------------------------------------------------------------
# Patch 7 — temperature-0 beam requests may ask for n > 1 outputs.
#   target:  vllm.sampling_params.SamplingParams._verify_greedy_sampling
#   why:     vLLM refuses n > 1 at temperature 0 (n identical greedy copies);
#            for beam search n is the number of best hypotheses returned.
#   how:     skip the check for params that name a DSBD knob in extra_args;
#            patch 6 restores vLLM's error on engines that are not DSBD.
#   remove-when: vLLM's SamplingParams knows beam decoding.
# ---------------------------------------------------------------------------
def _greedy_beam_requests() -> None:
    from vllm.sampling_params import SamplingParams

    from vllm_dsbd.engine import requests as beam_requests

    original = _original(SamplingParams, "_verify_greedy_sampling")

    def _verify_greedy_sampling(self) -> None:
        if beam_requests.is_beam_request(self):
            return None
        return original(self)

    SamplingParams._verify_greedy_sampling = _wrapped(original, _verify_greedy_sampling)
