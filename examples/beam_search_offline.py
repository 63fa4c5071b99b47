"""Beam search on the default SmolLM2 target with vLLM's offline API.

Run after `make demo` (or `vllm-dsbd models prepare`):

    .venv/bin/python examples/beam_search_offline.py
"""

from vllm import LLM
from vllm.sampling_params import BeamSearchParams

from vllm_dsbd import models
from vllm_dsbd.demo import engine_kwargs
from vllm_dsbd.dtypes import machine_dtype


def main() -> None:
    dtype = machine_dtype()  # bfloat16 where the CPU computes it natively, else float32
    print(f"dtype: {dtype.dtype} ({dtype.reason})")
    llm = LLM(**engine_kwargs(str(models.prepare_target()), dtype.dtype))
    prompts = [{"prompt": "The three primary colours are"}]
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=24))
    for beam in outputs[0].sequences:
        print(f"{beam.cum_logprob:8.3f}  {beam.text!r}")


if __name__ == "__main__":  # vLLM starts its processes by spawn
    main()
