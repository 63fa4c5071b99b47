"""Drafting the next DSBD iteration inside the verify step (the engine-wide knob ``draft_in_step``).

With an EAGLE-3 head, the runner draws the next iteration's γ draft layers right after it verified the
current one, in the same worker step, so an iteration costs one engine step instead of γ + 1. The head runs
on *forest rows* (``engine.forest_attention``), each reading the paged head KV of its beam's context:

- layer 1: per path that a new beam continues, its verified tokens (the root's last token, then the
  accepted draft tokens), fed the target's features of the tokens before them, their head KV also
  written to the path request's slots (the next iteration's context); then each new beam's last token
  (the one verification drew), whose ancestors are its path's verified rows;
- layer k: each draft node of layer k - 1 that does not finish, fed the head's own output at its parent,
  its ancestors the rows above it;
- each layer's W nodes are drawn by ``spec_step.draft_layer`` with the seed of the next iteration's draft
  step (``step + 1``, the same layer numbers), and the joints go to the runner's ``DraftStore``.

The scheduler then sets up the paths of the next forest at once (``BeamGroup.apply_drafted``). A request's
first iteration still drafts in draft steps, which also compute the head KV of its prompt.
"""

from __future__ import annotations

import torch

from vllm_dsbd.algorithm import token_finishes
from vllm_dsbd.engine import eagle3, forest_attention, spec_step
from vllm_dsbd.engine.protocol import DraftDecision, DraftStep, VerifyDecision, VerifyStep, first_path_through


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
    size = table.block_size
    depth, root_len = decision.num_passed, vs.seq_len  # the roots' last tokens are at root_len - 1

    def slot(blocks, pos: int) -> int:
        return int(blocks[pos // size]) * size + pos % size if pos >= 0 else -1

    # Layer 1's rows: per path a new beam continues, its verified tokens (the root's last token, then the accepted
    # draft tokens; their head KV also goes to the path request's slots), then each new beam's last token.
    rows = forest_attention.ForestRows([], [], [], forest_attention.ScratchKV(), slots=[])
    tokens, positions, feature_slots, last_rows, chains = [], [], [], [], {}

    def add(token: int, pos: int, blocks, paged: bool, ancestors: list[int]) -> int:
        tokens.append(token)
        positions.append(pos)
        feature_slots.append(slot(blocks, pos - 1))
        rows.block_tables.append(blocks)
        rows.context_lens.append(root_len - 1)
        rows.ancestors.append(ancestors)
        rows.slots.append(slot(blocks, pos) if paged else -1)
        return len(tokens) - 1

    for c in decision.beams:
        path = first_path_through(vs.paths, vs.aliases, c.parent)
        index = batch.req_id_to_index[vs.path_req_ids[path]]
        blocks = table.block_table.cpu[index]
        if path not in chains:
            verified = [int(batch.token_ids_cpu[index, root_len - 1])] + vs.path_tokens(path, depth)
            chain: list[int] = []
            for j, token in enumerate(verified):
                chain.append(add(token, root_len - 1 + j, blocks, True, list(chain)))
            chains[path] = chain
        last_rows.append(add(c.token, root_len + depth, blocks, False, list(chains[path])))
    features = runner._dsbd_features.read(torch.tensor(feature_slots, device=runner._dsbd_features.features.device))
    scores = [c.score for c in decision.beams]
    slots = list(range(len(last_rows)))
    # At T > 0 a head's draw needs only its draft vocabulary's columns: no scatter of its logits into all V.
    order = runner._dsbd_head_order if vs.temperature > 0 else None
    vocab = runner.model_config.get_vocab_size() if order is not None else None
    out = []
    for layer in range(1, layers + 1):
        logits, own = _forward(runner, tokens, positions, features, rows, last_rows, order)
        ds = DraftStep(
            group_id=vs.group_id, beam_width=vs.beam_width, temperature=vs.temperature, top_k=vs.top_k,
            top_p=vs.top_p, length_penalty=vs.length_penalty, ignore_eos=vs.ignore_eos,
            eos_token_id=vs.eos_token_id, stop_token_ids=vs.stop_token_ids, stop=vs.stop, seed=vs.seed,
            step=vs.step + 1, layer=layer, req_ids=tuple(str(s) for s in slots), slots=tuple(slots),
            scores=tuple(scores), seq_len=root_len + depth + layer)
        support = runner._dsbd_support if order is not None else runner._draft_support(logits)
        chosen, joint = spec_step.draft_layer(logits, {str(s): r for r, s in enumerate(slots)}, ds, support, vocab)
        if joint is not None:
            runner._dsbd_drafts.put(vs.group_id, vs.step + 1, layer, joint)
        out.append(chosen)
        grow = [j for j, t in enumerate(chosen.tokens)
                if not token_finishes(t, vs.eos_token_id, vs.ignore_eos, vs.stop_token_ids)]
        if layer == layers or not grow:
            break
        row_of_slot = {s: last_rows[r] for r, s in enumerate(slots)}  # a node's parent: its row in this call
        parents = [row_of_slot[chosen.parents[j]] for j in grow]
        tokens = [chosen.tokens[j] for j in grow]
        positions = [root_len + depth + layer] * len(grow)
        features = own[torch.tensor(parents, device=own.device)]
        rows = forest_attention.ForestRows(
            [rows.block_tables[r] for r in parents], [rows.context_lens[r] for r in parents],
            [rows.ancestors[r] + [rows.row_ids[r]] for r in parents], rows.scratch)
        last_rows = list(range(len(grow)))
        scores, slots = [chosen.scores[j] for j in grow], grow
    return out


def _forward(runner, tokens: list[int], positions: list[int], features: torch.Tensor,
             rows: forest_attention.ForestRows, logit_rows: list[int],
             order: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits at ``logit_rows`` ([len, V], or [len, K] over its draft vocabulary when ``order`` is
    given: ``eagle3.draft_vocabulary_logits``) and its own features at every forest row."""
    head = runner.drafter.model
    device = features.device
    normed, own = forest_attention.head_forward(
        head, runner._dsbd_forest_layers, runner.vllm_config, torch.tensor(tokens, device=device),
        torch.tensor(positions, device=device), features, rows)
    normed = normed[torch.tensor(logit_rows, device=device)]
    if order is not None:
        return eagle3.draft_vocabulary_logits(head, normed, order), own
    return head.compute_logits(normed), own
