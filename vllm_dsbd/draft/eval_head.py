"""``vllm-dsbd eval-head``: how often an EAGLE-3 head's draft chain agrees with its target, per depth.

On held-out prompts (``prompts.EVAL_PROMPTS``, never used for training) the
target answers greedily (vLLM, T = 0). The head is then teacher-forced on
prompt + answer exactly as DSBD feeds it (docs/dev/eagle3-internals.md): depth 1 reads the
target's features, depth k > 1 its own output of depth k - 1. For each answer
position p and depth k, the chain of k drafts starting after p agrees when
every draft is the target's own top-1 token (full vocabulary, after the
head's ``d2t`` map). ``agreement[k-1]`` is the fraction of chains of k that
agree: the expected acceptance of a depth-k chain at T = 0 (width 1);
``conditional[k-1]`` is depth k's agreement given depths 1..k-1 agreed.
``overlap[s]`` is the mean over answer positions of sum_x min(p(x), q_s(x)),
p the target's distribution at T = 1, q_s the head's at depth 1 at T = s
(its draft vocabulary, 0 elsewhere): the chance that one draft sampled from
the head is accepted at T = 1 (speculative sampling's alpha), the quantity
DSBD's acceptance at T > 0 grows with, for each draft temperature scale s.
With ``--compare-pair-draft`` the pair's small draft model is measured on the
same positions (``pair_draft``: its top-1 agreement, which is depth 1's, and
its overlap at T 1), the bar a head for that pair has to clear.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from vllm_dsbd.draft.evaluate import overlap
from vllm_dsbd.draft.prompts import EVAL_PROMPTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", required=True, help="the head (speculators format, as train-drafter writes)")
    p.add_argument("--out", default=None, help="result file (default: eval.json in --head)")
    p.add_argument("--depth", type=int, default=4, help="longest draft chain measured")
    p.add_argument("--num-prompts", type=int, default=len(EVAL_PROMPTS), help="held-out prompts measured")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest target answer per prompt")
    p.add_argument("--draft-temperature-scales", type=_scales, default=(1.0, 0.75),
                   help="draft temperature scales s of the overlap at T 1, comma-separated (default: 1,0.75)")
    p.add_argument("--compare-pair-draft", action="store_true",
                   help="also measure the pair's small draft model on the same positions (result: pair_draft)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $VLLM_DSBD_CACHE or ~/.cache/vllm-dsbd)")


def _scales(text: str) -> tuple[float, ...]:
    try:
        scales = tuple(float(x) for x in text.split(","))
    except ValueError:
        scales = ()
    if not scales or not all(math.isfinite(x) and x > 0 for x in scales):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: finite numbers > 0 separated by commas "
                                         "(draft temperature scales, e.g. 1,0.75)")
    return scales


def load_head(head_dir: Path, target_dir: Path):
    """A head written by ``eagle3_head.export`` as speculators' ``Eagle3DraftModel`` (float32, eval mode), its
    embeddings and verifier parts from the target."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from vllm_dsbd.draft.eagle3_head import ATTENTION, Refused

    config = Eagle3SpeculatorConfig.from_pretrained(head_dir)
    config.transformer_layer_config._attn_implementation = ATTENTION
    config.speculators_config.verifier.name_or_path = str(target_dir)
    weights = load_file(str(Path(head_dir) / "model.safetensors"))
    head = Eagle3DraftModel(config)
    head.load_vocab_mappings(weights.get("t2d"), weights.get("d2t"))  # none: the whole vocabulary
    head.load_verifier_weights()
    unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()},
                                      strict=False).unexpected_keys
    if unexpected:
        raise Refused(f"{head_dir}: weights the head does not have: {sorted(unexpected)}")
    return head.float().eval()


@torch.no_grad()
def chain_agreement(head, features, seqs: list[tuple[list[int], list[int]]], depth: int,
                    scales: tuple[float, ...] = (1.0,)) -> dict:
    """Per-depth agreement and depth-1 overlap of ``head`` (see the module doc) on (prompt, answer) pairs;
    ``features`` is an ``eagle3_head.TargetFeatures`` of the target."""
    from vllm_dsbd.draft.eagle3_head import example

    norm, lm_head = features.model.model.norm, features.model.lm_head
    hits, cond_total, total = torch.zeros(depth), torch.zeros(depth), torch.zeros(depth)
    overlaps = torch.zeros(len(scales))
    head_logits = []  # the head's logits of each unrolled step, in order
    hook = head.lm_head.register_forward_hook(lambda _m, _i, out: head_logits.append(out[0]))
    try:
        for prompt, answer in seqs:
            ids = list(prompt) + list(answer)
            aux, last = features(ids)
            target_logits = lm_head(norm(last))
            best = target_logits.argmax(-1)  # best[q]: the target's top-1 after position q
            ex = example(ids, len(prompt), aux, last)
            head_logits.clear()
            drafts = head(hidden_states=ex["hidden_states"], input_ids=ex["input_ids"], document_ids=ex["document_ids"],
                          position_ids=ex["position_ids"], ttt_steps=depth)
            n = len(ids)
            rows = torch.arange(len(prompt) - 1, n - 1)  # depth 1's answer tokens
            for j, s in enumerate(scales):
                overlaps[j] += overlap(target_logits[rows], head_logits[0][rows], head.d2t, s).sum()
            ok = torch.ones(n, dtype=torch.bool)  # the chain from row p agreed so far
            for k, d in enumerate(drafts):  # d[0, p]: the draft after position p + k
                tokens = d[0] if head.d2t is None else d[0] + head.d2t[d[0]]
                rows = torch.arange(len(prompt) - 1, n - 1 - k)  # chains whose k-th draft is an answer token
                step = tokens[rows] == best[rows + k]
                cond_total[k] += ok[rows].sum()
                ok[rows] &= step
                hits[k] += ok[rows].sum()
                total[k] += len(rows)
    finally:
        hook.remove()
    return {"agreement": [round(float(h / t), 4) for h, t in zip(hits, total)],
            "conditional": [round(float(h / c), 4) if c else None for h, c in zip(hits, cond_total)],
            "overlap": {str(s): round(float(o / total[0]), 4) for s, o in zip(scales, overlaps)},
            "positions": int(total[0])}


def pair_draft_agreement(features, draft_dir: Path, seqs: list[tuple[list[int], list[int]]]) -> dict:
    """A small draft model's top-1 agreement with the target and its overlap at T 1 (both models at T 1), on the
    answer positions ``chain_agreement`` measures; ``features`` holds the target (float32)."""
    from vllm_dsbd.draft.evaluate import agreement, load

    result = agreement(features.model, load(draft_dir), seqs, {"overlap_t1": 1.0})
    return {"draft": str(draft_dir), **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}}


def run(args: argparse.Namespace) -> int:
    from vllm_dsbd import pairs
    from vllm_dsbd.draft import distill
    from vllm_dsbd.draft.eagle3_head import TargetFeatures, head_config
    from vllm_dsbd.draft.evaluate import sample_held_out

    if args.threads:
        torch.set_num_threads(args.threads)
    head_dir = Path(args.head)
    target_dir = Path(pairs.pair_paths(args.pair, args.cache_dir).target)
    config = head_config(head_dir, "--head")
    t0 = time.time()
    prompts = list(EVAL_PROMPTS[: args.num_prompts])
    seqs = sample_held_out(target_dir, prompts, max_new_tokens=args.max_new_tokens, seed=0, temperature=0.0)
    features = TargetFeatures(target_dir, config["eagle_aux_hidden_state_layer_ids"])
    result = chain_agreement(load_head(head_dir, target_dir), features, seqs, args.depth, args.draft_temperature_scales)
    if args.compare_pair_draft:
        result["pair_draft"] = pair_draft_agreement(features, Path(pairs.pair_paths(args.pair, args.cache_dir).draft),
                                                    seqs)
    result.update({
        "pair": args.pair, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "answers": "the target's greedy answers (vLLM, T = 0); features and top-1 from HF float32",
        "machine": distill.machine(), "date": distill.now(), "eval_seconds": round(time.time() - t0, 1)})
    training = head_dir / "training.json"
    if training.exists():
        result["training"] = json.loads(training.read_text())
    distill.write_json(Path(args.out) if args.out else head_dir / "eval.json", result)
    print(json.dumps(result, indent=1))
    return 0
