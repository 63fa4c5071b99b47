"""DSBD beam search and beam sampling offline, drafting with the EAGLE-3 head that ships for the default target.

One engine does everything: its speculative config names the head, and each request says how it wants to
be decoded through ``extra_args`` (``num_speculative_tokens`` 0: in-engine beam decoding without the
draft). The script times, on the same prompts:

- DSBD beam search (T 0, lossless: the same beams as in-engine beam search) against in-engine beam search
  and against vLLM's own ``LLM.beam_search`` loop (run unchanged on the same engine);
- fixed-width DSBD beam sampling (T 1: distributed exactly as beam sampling) against in-engine beam sampling.

Run after ``make demo`` (or ``vllm-dsbd models prepare``)::

    .venv/bin/python examples/dsbd_offline.py --beam-width 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import time

PROMPTS = ["The capital of France is", "Here is a short story about a robot who learns to paint:"]


def beam_request(width: int, max_tokens: int, temperature: float, speculate: bool):
    """A beam request of ``width`` beams, returning all of them; ``speculate`` False: no draft for it."""
    from vllm import SamplingParams

    knobs = {"beam_width": width, "fixed_width": True}  # fixed width: exact beam sampling at T > 0
    if not speculate:
        knobs["num_speculative_tokens"] = 0  # in-engine beam decoding, one target step per token
    return SamplingParams(n=width, temperature=temperature, seed=0, max_tokens=max_tokens, extra_args=knobs)


def compare(llm, prompts: list[str], width: int, max_tokens: int) -> dict[str, tuple[float, list]]:
    """Each way of decoding ``prompts`` on ``llm``: name -> (seconds, the beams' token ids per prompt)."""
    from vllm.sampling_params import BeamSearchParams

    from vllm_dsbd.entrypoints.beam_search import vllm_builtin_beam_search

    def timed(run):
        start = time.perf_counter()
        result = run()
        return time.perf_counter() - start, result

    def generate(temperature, speculate):
        outputs = llm.generate(prompts, beam_request(width, max_tokens, temperature, speculate), use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outputs]

    def builtin():
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        outputs = vllm_builtin_beam_search(llm, [{"prompt": p} for p in prompts], params)
        return [[s.tokens for s in o.sequences] for o in outputs]

    generate(0.0, True)  # warm-up: a first request pays one-time costs
    return {
        "vLLM LLM.beam_search loop": timed(builtin),
        "in-engine beam search": timed(lambda: generate(0.0, False)),
        "DSBD beam search": timed(lambda: generate(0.0, True)),
        "in-engine beam sampling": timed(lambda: generate(1.0, False)),
        "DSBD beam sampling (fixed width)": timed(lambda: generate(1.0, True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beam-width", type=int, default=4, help="beams per request (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per beam (default: 32)")
    parser.add_argument("--num-speculative-tokens", type=int, default=1, help="draft depth γ (default: 1)")
    args = parser.parse_args()

    from vllm import LLM

    from vllm_dsbd import models
    from vllm_dsbd.dtypes import machine_dtype

    dtype = machine_dtype()  # bfloat16 where the CPU computes it natively, else float32
    print(f"dtype: {dtype.dtype} ({dtype.reason})")
    llm = LLM(model=str(models.prepare_target()), dtype=dtype.dtype, seed=0, max_model_len=1024,
              enforce_eager=True, block_size=32, kv_cache_memory_bytes=1 << 30,  # CPU settings
              speculative_config={"method": "dsbd", "model": str(models.default_head_path()),
                                  "num_speculative_tokens": args.num_speculative_tokens,
                                  "beam_width": args.beam_width})
    rows = compare(llm, PROMPTS, args.beam_width, args.max_tokens)
    for name, (seconds, _) in rows.items():
        print(f"{name:34s} {seconds:7.2f} s")
    search, in_engine = rows["DSBD beam search"], rows["in-engine beam search"]
    loop, sampling = rows["vLLM LLM.beam_search loop"], rows["in-engine beam sampling"]
    print(f"DSBD beam search: {in_engine[0] / search[0]:.2f}x in-engine beam search, "
          f"{loop[0] / search[0]:.2f}x vLLM's loop; same beams: {search[1] == in_engine[1]}")
    print(f"DSBD beam sampling: {sampling[0] / rows['DSBD beam sampling (fixed width)'][0]:.2f}x "
          f"in-engine beam sampling")
    tokenizer = llm.get_tokenizer()
    for prompt, beams in zip(PROMPTS, search[1]):
        print(f"--- {prompt!r}\n{tokenizer.decode(beams[0])!r}")


if __name__ == "__main__":  # vLLM starts its processes by spawn
    main()
