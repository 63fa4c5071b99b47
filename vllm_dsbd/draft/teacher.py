"""Teacher data: the target's own sampled answers with its next-token distributions.

The target, run by vLLM, answers chat prompts at temperature 1 (plain
multinomial sampling, no top-k/top-p; ``TeacherConfig.temperature`` sets
another, 0 for its greedy answers); for every generated position vLLM
also returns the target's top-``k`` log-probabilities (``logprobs=k``; the
rest of the vocabulary is one bucket with the remaining mass in training).

Data comes in shards of ``seqs_per_shard`` prompts. Shard ``i`` depends only
on (prompts, seed, i): every request has its own sampling seed, shards are
written atomically and skipped when they exist, so generation resumes where
it stopped and gives the same tokens for the same seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dsbd.draft.prompts import training_prompts


@dataclass(frozen=True)
class TeacherConfig:
    seqs_per_shard: int = 512
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    top_k: int = 64  # 0: answers only (no log-probs)
    temperature: float = 1.0  # of the answers (0: greedy); the log-probs stay the target's at T 1
    max_num_seqs: int = 128  # sequences vLLM decodes together
    dtype: str = "float32"  # the target's (bfloat16: about 1.7x faster on a CPU with native bf16)
    kv_cache_bytes: int = 3 << 30


def shard_path(data_dir: Path, index: int) -> Path:
    return Path(data_dir) / f"shard-{index:05d}.pt"


def num_shards(data_dir: Path) -> int:
    """Shards 0, 1, ... in ``data_dir`` (up to the first missing one)."""
    n = 0
    while shard_path(data_dir, n).exists():
        n += 1
    return n


def shard_prompts(num_shards: int, seed: int, seqs_per_shard: int) -> list[list[str]]:
    """The prompts of shards 0..num_shards-1; shard i's prompts do not depend on num_shards."""
    flat = training_prompts(num_shards * seqs_per_shard, seed)
    return [flat[i * seqs_per_shard : (i + 1) * seqs_per_shard] for i in range(num_shards)]


def shard_tokens(data_dir: Path, index: int) -> int:
    """Answer tokens in an existing shard."""
    return int(torch.load(shard_path(data_dir, index))["num_tokens"])


def shards_for_tokens(data_dir: Path, tokens: int) -> int | None:
    """How many shards, from shard 0, reach ``tokens`` answer tokens; None if not generated yet."""
    total = 0
    for i in range(1 << 20):
        if not shard_path(data_dir, i).exists():
            return None
        total += shard_tokens(data_dir, i)
        if total >= tokens:
            return i + 1
    raise AssertionError("unreachable")


def request_seed(seed: int, shard: int, row: int) -> int:
    """The sampling seed of one request: distinct for every (seed, shard, row)."""
    return (seed * 1_000_003 + shard) * 65_536 + row


def chat_ids(tokenizer, prompt: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of a one-turn chat ready for the assistant's answer (left-truncated)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)[-max_prompt_tokens:]


def engine_kwargs(target_dir: Path, cfg: TeacherConfig) -> dict:
    """vLLM settings for teacher sampling on a small CPU machine.

    The token budget of a step holds every running prompt whole: vLLM 0.32 on
    CPU fails on a seeded request whose prompt is split across steps by
    chunked prefill ("CPU Generator does not use offset").
    """
    return dict(
        model=str(target_dir),
        distributed_executor_backend="uni",  # in this process: see start_engine
        dtype=cfg.dtype,
        enforce_eager=True,
        seed=0,
        max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens,
        max_logprobs=max(cfg.top_k, 1),
        block_size=32,
        kv_cache_memory_bytes=cfg.kv_cache_bytes,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_seqs * (cfg.max_prompt_tokens + 1),
    )


def start_engine(target_dir: Path, cfg: TeacherConfig):
    """A vLLM ``LLM`` for the target that runs inside this process, on torch's threads.

    The default multi-process engine keeps a second process busy-polling its
    worker (about one core of a 2-core machine) while the worker computes; in
    one process the teacher uses one core (with ``torch.set_num_threads(1)``).
    """
    from vllm import LLM

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old = os.environ.get(key)
    os.environ[key] = "0"
    try:
        return LLM(**engine_kwargs(target_dir, cfg))
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def sampling_params(seeds: list[int], *, max_new_tokens: int, top_k: int | None, temperature: float = 1.0):
    """One vLLM SamplingParams per request: plain seeded sampling, with the top-k log-probs of
    each generated position unless ``top_k`` is None."""
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=temperature, max_tokens=max_new_tokens, logprobs=top_k, seed=s,
                       flat_logprobs=True, detokenize=False)
        for s in seeds
    ]


def top_k_of_position(token_ids: list[int], logprobs: list[float], ranks: list[int], k: int):
    """The k best (id, log-prob) of one position, best first.

    vLLM returns the sampled token first (with its rank) and then ranks 1..k,
    so the sampled token appears twice when it is in the top k and is a
    (k+1)-th entry when it is not; both cases reduce to ranks 1..k.
    """
    best = {r: (t, lp) for t, lp, r in zip(token_ids, logprobs, ranks) if r is not None and 1 <= r <= k}
    if len(best) != k:
        raise ValueError(f"expected ranks 1..{k} in the returned log-probs, got {sorted(best)}")
    return [best[r][0] for r in range(1, k + 1)], [best[r][1] for r in range(1, k + 1)]


def rows_from_outputs(prompt_ids: list[list[int]], outputs, top_k: int) -> list[dict]:
    """Teacher rows from vLLM ``RequestOutput``s (same order as ``prompt_ids``).

    Each row: ``prompt`` (list[int]), ``answer`` (list[int], up to and
    including EOS), and unless ``top_k`` is 0, ``top_ids`` [len(answer), top_k]
    int32 and ``top_logp`` [len(answer), top_k] float16 (the target's log-probs
    at T=1).
    """
    rows = []
    for prompt, out in zip(prompt_ids, outputs):
        comp = out.outputs[0]
        if not top_k:
            rows.append({"prompt": list(prompt), "answer": list(comp.token_ids)})
            continue
        lp = comp.logprobs  # FlatLogprobs: one entry per answer position
        if len(lp) != len(comp.token_ids):
            raise ValueError(f"{len(lp)} log-prob positions for {len(comp.token_ids)} tokens")
        ids, vals = [], []
        for pos in range(len(lp)):
            a, b = lp.start_indices[pos], lp.end_indices[pos]
            i, v = top_k_of_position(lp.token_ids[a:b], lp.logprobs[a:b], lp.ranks[a:b], top_k)
            ids.append(i)
            vals.append(v)
        rows.append({
            "prompt": list(prompt),
            "answer": list(comp.token_ids),
            "top_ids": torch.tensor(ids, dtype=torch.int32).reshape(-1, top_k),
            "top_logp": torch.tensor(vals, dtype=torch.float32).reshape(-1, top_k).to(torch.float16),
        })
    return rows


def sample_rows(llm, prompt_ids: list[list[int]], seeds: list[int], *, max_new_tokens: int, top_k: int,
                temperature: float = 1.0) -> list[dict]:
    """The target (a vLLM ``LLM``) answers every prompt once; see :func:`rows_from_outputs`."""
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        sampling_params(seeds, max_new_tokens=max_new_tokens, top_k=top_k or None, temperature=temperature),
        use_tqdm=False,
    )
    return rows_from_outputs(prompt_ids, outputs, top_k)


def generate_shards(target_dir: Path, data_dir: Path, *, tokens: int, seed: int, cfg: TeacherConfig,
                    progress=None, shards: int | None = None) -> int:
    """Write shards 0, 1, ... into ``data_dir`` until they hold ``tokens`` answer tokens (``shards``: until
    shards 0..shards-1 exist, whatever their tokens).

    Existing shards are kept (generation resumes); returns the number of shards.
    ``progress`` (a tqdm bar) counts answer tokens.
    """
    from transformers import AutoTokenizer

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok, llm, total, i = None, None, 0, 0
    try:
        while (total < tokens) if shards is None else (i < shards):
            final = shard_path(data_dir, i)
            if not final.exists():
                if llm is None:
                    tok = AutoTokenizer.from_pretrained(target_dir)
                    llm = start_engine(target_dir, cfg)
                prompts = shard_prompts(i + 1, seed, cfg.seqs_per_shard)[i]
                ids = [chat_ids(tok, p, cfg.max_prompt_tokens) for p in prompts]
                seeds = [request_seed(seed, i, j) for j in range(len(ids))]
                rows = sample_rows(llm, ids, seeds, max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k,
                                   temperature=cfg.temperature)
                n = sum(len(r["answer"]) for r in rows)
                tmp = final.with_suffix(f".tmp{os.getpid()}")
                torch.save({"index": i, "seed": seed, "num_tokens": n, "rows": rows}, tmp)
                os.replace(tmp, final)
            n = shard_tokens(data_dir, i)
            total += n
            if progress is not None:
                progress.update(n)
            i += 1
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    return i
