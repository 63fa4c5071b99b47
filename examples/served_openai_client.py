"""A served DSBD engine queried with the ``openai`` Python client: completions and chat, beam search and
beam sampling, per-request knobs in ``vllm_xargs``.

Start a server first (the default pair, drafting with the shipped EAGLE-3 head)::

    TARGET=$(.venv/bin/python -c 'from vllm_dsbd import models; print(models.prepare_target())')
    .venv/bin/vllm-dsbd serve "$TARGET" --served-model-name smollm2 --enforce-eager --block-size 32 \\
        --kv-cache-memory-bytes 1073741824 --speculative-method dsbd \\
        --speculative-config '{"model": "vllm_dsbd/draft/default-head", "num_speculative_tokens": 1, "beam_width": 4}'

then::

    .venv/bin/python examples/served_openai_client.py --base-url http://localhost:8000/v1 --model smollm2
"""

from __future__ import annotations

import argparse


def query(client, model: str, width: int = 4, max_tokens: int = 24) -> dict[str, list[str]]:
    """Four requests a DSBD server answers; name -> the texts returned, best first."""
    prompt = "Once upon a time"
    chat = [{"role": "user", "content": "Name three colours."}]
    # lossless speculative beam search: the n best of a width-n beam search
    search = client.completions.create(model=model, prompt=prompt, n=width, max_tokens=max_tokens,
                                       extra_body={"use_beam_search": True})
    # beam sampling with DSBD, fixed width: distributed exactly as beam sampling; two of the four beams returned
    sampled = client.completions.create(model=model, prompt=prompt, n=2, max_tokens=max_tokens, temperature=1.0,
                                        seed=0, extra_body={"vllm_xargs": {"beam_width": width, "fixed_width": True}})
    # chat, beam search through use_beam_search, with a stop string it honours
    chat_search = client.chat.completions.create(model=model, messages=chat, n=2, max_tokens=max_tokens,
                                                 stop=["\n\n"], extra_body={"use_beam_search": True})
    # chat, in-engine beam sampling: no draft for this request (γ 0); the best of four beams returned
    chat_sampled = client.chat.completions.create(
        model=model, messages=chat, n=1, max_tokens=max_tokens, temperature=0.8, seed=1,
        extra_body={"vllm_xargs": {"beam_width": width, "num_speculative_tokens": 0}})
    return {
        "completions, use_beam_search": [c.text for c in search.choices],
        "completions, DSBD beam sampling": [c.text for c in sampled.choices],
        "chat, use_beam_search": [c.message.content for c in chat_search.choices],
        "chat, in-engine beam sampling": [c.message.content for c in chat_sampled.choices],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="the server's /v1 address")
    parser.add_argument("--model", default="smollm2", help="the server's --served-model-name")
    parser.add_argument("--beam-width", type=int, default=4, help="beams per request (default: 4)")
    args = parser.parse_args()

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="unused")  # the server checks no key unless told to
    for name, texts in query(client, args.model, args.beam_width).items():
        print(f"=== {name}")
        for text in texts:
            print(f"  {text!r}")


if __name__ == "__main__":
    main()
