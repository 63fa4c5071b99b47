"""MJSD offline: one sequence per request, drafted by the EAGLE-3 head that ships for the default target.

MJSD (multi-token joint speculative decoding) runs on a DSBD engine: a request with
``extra_args={"decoder": "mjsd"}`` draws ``beam_width`` draft beams for γ steps, the target checks the
likeliest draft path in one forward, and the longest prefix whose likelihood ratio passes ``mjsd_tau`` is
kept, plus one target token. At temperature 0 its output is the target's greedy output; at temperature > 0
it trades likelihood for speed through ``mjsd_tau`` (not the target's sampling distribution).

Run after ``make demo`` (or ``vllm-dsbd models prepare``)::

    .venv/bin/python examples/mjsd_offline.py --max-tokens 32
"""

from __future__ import annotations

import argparse
import time

PROMPTS = ["The capital of France is", "Here is a short story about a robot who learns to paint:"]


def mjsd_request(max_tokens: int, temperature: float, tau: float = 0.5, draft_beams: int = 4, gamma: int = 2):
    """One MJSD request: ``draft_beams`` draft beams (K), γ draft steps, threshold τ."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, seed=0, max_tokens=max_tokens,
                          extra_args={"decoder": "mjsd", "beam_width": draft_beams,
                                      "num_speculative_tokens": gamma, "mjsd_tau": tau})


def compare(llm, prompts: list[str], max_tokens: int, gamma: int = 2) -> dict[str, tuple[float, list]]:
    """MJSD and plain decoding of ``prompts`` on ``llm``: name -> (seconds, token ids per prompt)."""
    from vllm import SamplingParams

    def timed(params):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    timed(mjsd_request(max_tokens, 1.0, gamma=gamma))  # warm-up: a first request pays one-time costs
    return {
        "vLLM greedy": timed(SamplingParams(temperature=0.0, max_tokens=max_tokens)),
        "MJSD, T 0": timed(mjsd_request(max_tokens, 0.0, gamma=gamma)),
        "vLLM sampling, T 1": timed(SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens)),
        "MJSD, T 1, tau 0.5": timed(mjsd_request(max_tokens, 1.0, gamma=gamma)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, help="draft depth γ (default: 2)")
    args = parser.parse_args()

    from vllm import LLM

    from vllm_dsbd import models
    from vllm_dsbd.dtypes import machine_dtype

    dtype = machine_dtype()
    print(f"dtype: {dtype.dtype} ({dtype.reason})")
    llm = LLM(model=str(models.prepare_target()), dtype=dtype.dtype, seed=0, max_model_len=1024,
              enforce_eager=True, block_size=32, kv_cache_memory_bytes=1 << 30,
              speculative_config={"method": "dsbd", "model": str(models.default_head_path()),
                                  "num_speculative_tokens": args.num_speculative_tokens, "beam_width": 4})
    rows = compare(llm, PROMPTS, args.max_tokens, args.num_speculative_tokens)
    for name, (seconds, _) in rows.items():
        print(f"{name:22s} {seconds:7.2f} s")
    print(f"MJSD at T 0 gives greedy's tokens: {rows['MJSD, T 0'][1] == rows['vLLM greedy'][1]}")
    tokenizer = llm.get_tokenizer()
    for prompt, tokens in zip(PROMPTS, rows["MJSD, T 1, tau 0.5"][1]):
        print(f"--- {prompt!r}\n{tokenizer.decode(tokens)!r}")


if __name__ == "__main__":  # vLLM starts its processes by spawn
    main()
