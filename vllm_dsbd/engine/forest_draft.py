"""Drafting the next DSBD iteration inside the verify step (the engine-wide knob ``draft_in_step``).

With an EAGLE-3 head, the runner draws the next iteration's γ draft layers right after it verified the
current one, in the same worker step, so an iteration costs one engine step instead of γ + 1:

- every target step also runs the head over its rows (``DSBDModelRunnerMixin._target_forward_with_features``),
  so the head's paged KV of every verified token is computed from the target's own features;
- each new beam's last token (the token verification drew) is a forest row
  (``engine.forest_attention``): it reads its path request's paged head KV up to the accepted tokens and
  the target's feature of the token before it; each draft node of layer k is a row whose ancestors are
  the rows above it, fed the head's own output at its parent;
- each layer's W nodes are drawn by ``spec_step.draft_layer`` with the seed of the next iteration's draft
  step (``step + 1``, the same layer numbers), and the joints go to the runner's ``DraftStore``.

The scheduler then sets up the paths of the next forest at once (``BeamGroup.apply_drafted``). A request's
first iteration still drafts in draft steps (its beams come from a prefill, not a verification).
"""

from __future__ import annotations

import torch

from vllm_dsbd.algorithm import token_finishes
from vllm_dsbd.engine import eagle3, forest_attention, spec_step
from vllm_dsbd.engine.protocol import DraftDecision, DraftStep, VerifyDecision, VerifyStep


def num_layers(vs: VerifyStep, decision: VerifyDecision) -> int:
    """γ of the next iteration: ``draft_next``, cut so no draft reaches beyond max_tokens
    (``BeamGroup.max_draft_layers`` after the commit)."""
    left = vs.max_tokens_left - (decision.num_passed + 1)
    return max(0, min(vs.draft_next, left - 1)) if decision.beams else 0


def draft(runner, vs: VerifyStep, decision: VerifyDecision) -> list[DraftDecision]:
    """The next iteration's draft layers for one verified group (see the module docstring)."""
    layers = num_layers(vs, decision)
    if layers == 0:
        return []
    batch = runner.input_batch
    table = batch.block_table[runner._dsbd_features_gid]
    aliases = dict(vs.aliases)
    depth = decision.num_passed
    position = vs.seq_len + depth  # of every new beam's last token (the roots' last tokens are at seq_len - 1)
    blocks, feature_slots, tokens = [], [], []
    for c in decision.beams:
        parent = aliases.get(c.parent, c.parent)
        path = next(k for k, nodes in enumerate(vs.paths) if parent in nodes)
        row_blocks = table.block_table.cpu[batch.req_id_to_index[vs.path_req_ids[path]]]
        blocks.append(row_blocks)
        feature_slots.append(eagle3.previous_slots(torch.tensor([position]), torch.tensor([0]), row_blocks[None],
                                                   table.block_size))
        tokens.append(c.token)
    features = runner._dsbd_features.read(torch.cat(feature_slots).to(runner._dsbd_features.features.device))
    scratch = forest_attention.ScratchKV()
    rows = forest_attention.ForestRows(blocks, [position] * len(tokens), [[] for _ in tokens], scratch)
    scores = [c.score for c in decision.beams]
    slots = list(range(len(tokens)))
    out = []
    for layer in range(1, layers + 1):
        logits, own = _forward(runner, tokens, [position + layer - 1] * len(tokens), features, rows)
        ds = DraftStep(
            group_id=vs.group_id, beam_width=vs.beam_width, temperature=vs.temperature, top_k=vs.top_k,
            top_p=vs.top_p, length_penalty=vs.length_penalty, ignore_eos=vs.ignore_eos,
            eos_token_id=vs.eos_token_id, stop_token_ids=vs.stop_token_ids, stop=vs.stop, seed=vs.seed,
            step=vs.step + 1, layer=layer, req_ids=tuple(str(s) for s in slots), slots=tuple(slots),
            scores=tuple(scores), seq_len=position + layer)
        chosen, joint = spec_step.draft_layer(logits, {str(s): r for r, s in enumerate(slots)}, ds)
        if joint is not None:
            runner._dsbd_drafts.put(vs.group_id, vs.step + 1, layer, joint)
        out.append(chosen)
        grow = [j for j, t in enumerate(chosen.tokens)
                if not token_finishes(t, vs.eos_token_id, vs.ignore_eos, vs.stop_token_ids)]
        if layer == layers or not grow:
            break
        row_of_slot = {s: r for r, s in enumerate(slots)}
        parent_rows = [row_of_slot[chosen.parents[j]] for j in grow]
        tokens = [chosen.tokens[j] for j in grow]
        features = own[torch.tensor(parent_rows, device=own.device)]
        rows = forest_attention.ForestRows(
            [rows.block_tables[r] for r in parent_rows], [rows.context_lens[r] for r in parent_rows],
            [rows.ancestors[r] + [rows.row_ids[r]] for r in parent_rows], scratch)
        scores, slots = [chosen.scores[j] for j in grow], grow
    return out


def _forward(runner, tokens: list[int], positions: list[int], features: torch.Tensor,
             rows: forest_attention.ForestRows) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits [rows, V] and own features at forest rows."""
    head = runner.drafter.model
    device = features.device
    normed, own = forest_attention.head_forward(
        head, runner._dsbd_forest_layers, runner.vllm_config, torch.tensor(tokens, device=device),
        torch.tensor(positions, device=device), features, rows)
    return head.compute_logits(normed), own
