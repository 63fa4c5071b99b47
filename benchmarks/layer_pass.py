"""How often a draft layer passes verification, today and under other exact rules.

Measures before building (the exact modes that pass more layers): a DSBD engine (default pair with the
shipped head drafting in-step, or ``--draft``) decodes chat prompts at T 0 and at T 1 with fixed width, and
every verification the runner makes is analysed as it happens (in-process engine: the runner's
``verify_step.verify_groups`` and ``spec_step.draft_layers`` are wrapped; decisions are unchanged):

- **today**: the layers the engine passed (T 0: a layer passes if each of the target's W new beams is a
  draft node or is left out by the engine's bound, docs/algorithm.md; fixed width: W of W drafts accepted).
  Results recorded before the engine had the bound (``layer-pass``, ``layer-pass-qwen``) count draft nodes
  only;
- **bound (T 0)**: a target beam the draft missed may be left out when its cumulative log-prob is strictly
  below the W-th best candidate among the drafted beams' children (log-probs are <= 0, so none of its
  children can rank): the layers that would pass so, computed exactly from the forest's target logits
  (EOS hypotheses of left-out beams are not resolved here: the outputs run with ``ignore_eos``). With
  ``ignore_eos`` the engine's rule is this one but for how it ranks (length-penalised scores, as vLLM
  does), so today and bound nearly agree; where this analysis would pass fewer layers than the engine, the
  engine's count is taken and the step counted (``bound_below_engine``);
- **M drafts (layer 1)**: with M = W + 2 and 2W draft nodes instead of W: at T 0 whether the target's W
  beams are among the draft's top M (the draft's beam search at width M from the same logits); at fixed
  width the probability that at least W of M i.i.d. drafts are accepted (the acceptance chain's count
  distribution over the layer's residual ladder of P and Q; today's W drafts likewise, beside the realised
  rate). Deeper layers need draft logits at nodes the forest never had: not measured.

Then the layers per verify step and a projected speedup against in-engine beam decoding at today's step
costs: layers per verify step / (the verify step's cost in beam steps, ``--verify-cost``, plus
``--row-cost`` per extra forest row). A projection, not a measurement.

    python -m benchmarks.layer_pass --num-prompts 8 --max-tokens 32 --out benchmarks/results/layer-pass
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import torch

import vllm_dsbd
from benchmarks.bench_dsbd import _is_head
from benchmarks.machine import machine_facts
from benchmarks.run import load_prompts
from benchmarks.scripts import write_result
from vllm_dsbd import pairs
from vllm_dsbd.algorithm import joint_probs, tempered_logprobs
from vllm_dsbd.algorithm.verify import acceptance_count_distribution, residual_ladder, restrict_to_parents
from vllm_dsbd.engine.protocol import layer_slot, node_id

EXTRA = {"W+2": 2, "2W": None}  # M - W (None: W)
VERIFY_COST = {1: 1.35, 2: 1.66}  # a verify step in beam steps, shipped head in-step (benchmarks.gap, bf16)
SHIPPED_HEAD = Path(vllm_dsbd.__file__).parent / "draft" / "default-head"


class Recorder:
    """Wraps the runner's verification and draft layers; tallies per mode."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.top_m: dict[tuple[str, int], dict[str, set]] = {}  # (group, iteration) -> M name -> layer-1 nodes
        self.tally: dict[str, dict] = defaultdict(lambda: defaultdict(float))

    def draft_layers(self, real):
        def wrapped(logits, rows, steps, support=None, vocab_size=None):
            out = real(logits, rows, steps, support, vocab_size)
            for group_rows, ds in zip(rows, steps):
                if ds.temperature == 0 and ds.layer == 1 and not ds.mjsd:
                    import dataclasses

                    sets = {}
                    for name, extra in EXTRA.items():
                        m = ds.beam_width + (extra if extra is not None else ds.beam_width)
                        ((wide, _),) = real(logits, [group_rows], [dataclasses.replace(ds, beam_width=m)], support,
                                            vocab_size)
                        sets[name] = set(zip(wide.parents, wide.tokens))
                    self.top_m[(ds.group_id, ds.step)] = sets
            return out
        return wrapped

    def verify_groups(self, real, node_logits):
        def wrapped(logits, groups, stops=None):
            decisions = real(logits, groups, stops)
            for g in groups:
                if g.vs.mjsd_tau is None and g.vs.draft_parents:
                    nodes = node_logits(logits, [g], len(g.vs.draft_parents))[0].float()  # [γ+1, W, V]
                    self._observe(g, nodes, decisions[g.vs.group_id])
            return decisions
        return wrapped

    def _observe(self, g, nodes: torch.Tensor, decision) -> None:
        vs, width = g.vs, self.width
        layers = len(vs.draft_parents)
        mode = "T 0" if vs.temperature == 0 else "fixed width"
        t = self.tally[mode]
        t["verify_steps"] += 1
        t["draft_layers"] += layers
        t["passed_today"] += decision.num_passed
        t["layer1_today"] += decision.num_passed >= 1
        if vs.temperature == 0:
            bound = _greedy_bound_passes(vs, nodes)
            if bound < decision.num_passed:  # the engine ranks as vLLM does (length-penalised scores, EOS
                t["bound_below_engine"] += 1  # children), this analysis by cumulative log-prob: counted
                bound = decision.num_passed  # the bound only adds to today's rule
            t["passed_bound"] += bound
            t["layer1_bound"] += bound >= 1
            tops = self.top_m.pop((vs.group_id, vs.step), None)
            if tops is not None:
                t["m_observed"] += 1
                beams = _target_beams(vs, nodes[0], torch.tensor(vs.root_scores, dtype=torch.float64), width)
                for name, drafted in tops.items():
                    t[f"layer1_{name}"] += all((p, tok) in drafted for p, tok, _ in beams)
        elif g.draft_joints is not None:
            for name, rate in _sampled_layer1_rates(vs, nodes, g.draft_joints[0], g.draft_support).items():
                t[f"layer1_{name}"] += rate
            t["m_observed"] += 1


def _target_beams(vs, lp_rows: torch.Tensor, parent_scores: torch.Tensor, width: int):
    """The target's W best (parent slot, token, cum log-prob) over valid parents' children (T 0, ignore_eos)."""
    lp = torch.log_softmax(lp_rows.float(), -1).double()  # [W, V]
    valid = torch.tensor([bool(v) for v in vs.root_valid]) if parent_scores.shape[0] == len(vs.root_valid) else None
    scores = parent_scores[:, None] + lp
    if valid is not None:
        scores[~valid] = float("-inf")
    top = scores.flatten().topk(width)
    vocab = lp.shape[-1]
    return [(int(i) // vocab, int(i) % vocab, float(s)) for s, i in zip(top.values, top.indices)]


def _greedy_bound_passes(vs, nodes: torch.Tensor) -> int:
    """Layers that pass when a missed target beam below the W-th best child of the drafted beams is left out."""
    width = vs.beam_width
    slots = list(range(width))  # the current beams' nodes: layer 0 slots
    scores = torch.tensor(vs.root_scores, dtype=torch.float64)
    valid = torch.tensor([bool(v) for v in vs.root_valid])
    lp_all = torch.log_softmax(nodes, -1).double()  # [γ+1, W, V]
    for layer in range(len(vs.draft_parents)):
        rows = lp_all[layer, slots] if layer else lp_all[0]
        cand = (scores[:, None] + rows).masked_fill(~valid[:, None], float("-inf"))  # [B, V]
        top = cand.flatten().topk(width)
        vocab = rows.shape[-1]
        beams = [(int(i) // vocab, int(i) % vocab, float(s)) for s, i in zip(top.values, top.indices) if s > -1e300]
        drafted = {}
        for slot in range(width):
            if vs.draft_exists[layer][slot]:
                parent = vs.draft_parents[layer][slot]
                drafted.setdefault((parent, vs.draft_tokens[layer][slot]), slot)
        # beam k's parent index is into `slots` order: map to the layer's slot of that parent
        kept = [(b, drafted[(_slot_of(slots, layer, b[0]), b[1])]) for b in beams
                if (_slot_of(slots, layer, b[0]), b[1]) in drafted]
        missed = [b for b in beams if (_slot_of(slots, layer, b[0]), b[1]) not in drafted]
        if not kept:
            return layer
        if missed:  # the drafted beams' children: their rows are on the forest's next layer
            kept_slots = [s for _, s in kept]
            kept_scores = torch.tensor([b[2] for b, _ in kept], dtype=torch.float64)
            children = kept_scores[:, None] + lp_all[layer + 1, kept_slots]
            wth = children.flatten().topk(width).values[-1]
            if not all(m[2] < float(wth) for m in missed):
                return layer
        slots = [s for _, s in kept]
        scores = torch.tensor([b[2] for b, _ in kept], dtype=torch.float64)
        valid = torch.ones(len(slots), dtype=torch.bool)
    return len(vs.draft_parents)


def _slot_of(slots: list[int], layer: int, index: int) -> int:
    """The layer slot of the ``index``-th current beam (layer 0: the root slot itself)."""
    return slots[index] if layer else index


def _sampled_layer1_rates(vs, nodes: torch.Tensor, joint: torch.Tensor, support) -> dict[str, float]:
    """Pr(at least W of M drafts accepted) at layer 1, fixed width, for M = W (today), W + 2 and 2W."""
    width = vs.beam_width
    lp = tempered_logprobs(nodes[0], vs.temperature)  # [W, V]
    vocab = lp.shape[-1]
    valid = torch.tensor([bool(v) for v in vs.root_valid])[None]
    p = joint_probs(torch.tensor([vs.root_scores], dtype=torch.float64), valid, lp[None],
                    torch.tensor([vs.top_k]), torch.tensor([vs.top_p]))  # [1, W*V]
    q = joint.float()
    if support is not None:  # a joint over the support's columns: the whole vocabulary's
        full = q.new_zeros((width, vocab))
        full[:, support] = q.view(width, -1)
        q = full.view(-1)
    restricted = restrict_to_parents(q[None], valid)
    out = {}
    for name, m in (("W", width), *((n, width + (e if e is not None else width)) for n, e in EXTRA.items())):
        _, alpha = residual_ladder(p, restricted, m)
        counts = acceptance_count_distribution(alpha)  # [1, m + 1]
        out[name] = float(counts[0, width:].sum())
    return out


def run(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner in this process: its functions wrapped
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import dsbd_engine_kwargs
    from vllm_dsbd.engine import spec_step, verify_step

    pair = pairs.pair_paths(args.pair)
    target = str(pair.target)
    draft = args.draft or (str(SHIPPED_HEAD) if args.pair == "default" else str(pair.draft))
    head = _is_head(draft)
    recorder = Recorder(args.width)
    spec_step.draft_layers = recorder.draft_layers(spec_step.draft_layers)
    verify_step.verify_groups = recorder.verify_groups(verify_step.verify_groups, verify_step._node_logits)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(Path(args.prompts_file), args.num_prompts, tokenizer)
    llm = LLM(**dsbd_engine_kwargs(target, draft, args.gamma, args.width, "float32",
                                   **({"draft_in_step": True} if head else {})))
    inputs = [{"prompt_token_ids": list(p.token_ids)} for p in prompts]
    for temperature in (0.0, 1.0):
        extra = {"beam_width": args.width, "num_speculative_tokens": args.gamma, "fixed_width": True}
        params = [SamplingParams(n=args.width, temperature=temperature, seed=k, max_tokens=args.max_tokens,
                                 ignore_eos=True, extra_args=extra) for k in range(len(prompts))]
        llm.generate(inputs, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    summary = {}
    for mode, t in recorder.tally.items():
        steps, m_obs = t["verify_steps"], max(t["m_observed"], 1)
        row = {"verify_steps": int(steps), "layers_per_verify_step_today": 1 + t["passed_today"] / steps,
               "layer1_pass_today": t["layer1_today"] / steps}
        if mode == "T 0":
            row["layers_per_verify_step_bound"] = 1 + t["passed_bound"] / steps
            row["layer1_pass_bound"] = t["layer1_bound"] / steps
            row["bound_below_engine"] = int(t["bound_below_engine"])  # steps this analysis ranked differently
        else:
            row["layer1_pass_expected_W"] = t["layer1_W"] / m_obs
        for name, extra in EXTRA.items():
            row[f"layer1_pass_M_{name}"] = t[f"layer1_{name}"] / m_obs
        rows_today = args.width * (args.gamma + 1)
        for key in [k for k in row if k.startswith("layers_per_verify_step")]:
            row[key.replace("layers_per_verify_step", "projected_speedup")] = row[key] / args.verify_cost
        for name, extra in EXTRA.items():  # layer 1 with M drafts: the other layers as today
            m_extra = extra if extra is not None else args.width
            layers = row["layers_per_verify_step_today"] + (row[f"layer1_pass_M_{name}"] - row["layer1_pass_today"])
            cost = args.verify_cost + args.row_cost * m_extra * args.gamma
            row[f"projected_speedup_M_{name}"] = layers / cost
        summary[mode] = row
        print(mode, {k: round(v, 3) for k, v in row.items()}, flush=True)
    return {"benchmark": "layer_pass", "machine": machine_facts(),
            "settings": {"pair": args.pair, "draft": Path(draft).name, "width": args.width, "gamma": args.gamma,
                         "max_tokens": args.max_tokens, "prompts": len(prompts), "draft_in_step": head,
                         "dtype": "float32", "verify_cost": args.verify_cost, "row_cost": args.row_cost,
                         "forest_rows_today": rows_today},
            "summary": summary}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels, values = [], []
    for mode, row in result["summary"].items():
        for key in ("layer1_pass_today", "layer1_pass_bound", "layer1_pass_M_W+2", "layer1_pass_M_2W"):
            if key in row:
                labels.append(f"{mode}\n{key.replace('layer1_pass_', '')}")
                values.append(row[key])
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("layer 1 passes (fraction of verify steps)")
    s = result["settings"]
    ax.set_title(f"Draft layer 1 pass rate, W {s['width']}, γ {s['gamma']}, {s['prompts']} prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="default", help="model pair (vllm_dsbd.pairs)")
    parser.add_argument("--draft", default=None,
                        help="draft checkpoint or EAGLE-3 head (default: the shipped head; another pair's draft)")
    parser.add_argument("--width", type=int, default=4, help="beam width W")
    parser.add_argument("--gamma", type=int, default=1, help="draft layers per iteration")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--num-prompts", type=int, default=8, help="chat prompts (benchmarks/prompts)")
    parser.add_argument("--prompts-file", default="benchmarks/prompts/prompts.json", help="prompts JSON")
    parser.add_argument("--verify-cost", type=float, default=None,
                        help="a verify step's cost in beam steps (default: as measured with the shipped head, "
                             "1.35 at γ 1, 1.66 at γ 2)")
    parser.add_argument("--row-cost", type=float, default=0.05,
                        help="the cost of one more forest row, in beam steps (measured: 1.3-2 ms a row)")
    parser.add_argument("--out", default="benchmarks/results/layer-pass", help="folder for the JSON and PNG")
    args = parser.parse_args()
    if args.verify_cost is None:
        if args.gamma not in VERIFY_COST:
            parser.error(f"--verify-cost is needed at γ {args.gamma} (measured defaults: γ {sorted(VERIFY_COST)})")
        args.verify_cost = VERIFY_COST[args.gamma]
    write_result(run(args), Path(args.out), "layer_pass", plot)


if __name__ == "__main__":
    main()
