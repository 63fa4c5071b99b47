"""Deliberately broken variants of ``verify``'s internals, for proving the statistical checks can fail.

Each entry maps a bug name to ``(attribute of vllm_dsbd.algorithm.verify, replacement)``,
applied with pytest's ``monkeypatch.setattr(verify, name, replacement)``.
"""

import torch


def _no_residual(current, restricted_draft, out):
    """Bug: after a rejection the chain keeps R instead of norm(max(R - Q', 0))."""
    out.copy_(current)
    return (current - restricted_draft).clamp_min(0).sum(-1)


def _no_reset(rejections, accepted):
    """Bug: after an acceptance the next slot starts from the current residual, not from P."""
    return rejections if accepted else rejections + 1


def _renormalised_restriction(draft_joint, parent_valid):
    """Bug: Q restricted to the valid parents is renormalised."""
    num_groups, num_beams = parent_valid.shape
    q = (draft_joint.reshape(num_groups, num_beams, -1) * parent_valid[:, :, None]).reshape(num_groups, -1)
    return q / q.sum(-1, keepdim=True).clamp_min(1e-30)


def _all_drafts_valid(accepted, tokens, eos_token_id, ignore_eos, stop_token_ids=(), stop_strings=None):
    """Bug: every draft of a passed layer (rejected or never examined ones too) parents the next layer."""
    return torch.ones_like(accepted)


BUGS = {
    "no-residual-update": ("_residual", _no_residual),
    "no-reset-after-acceptance": ("_next_rejections", _no_reset),
    "renormalised-restricted-draft": ("restrict_to_parents", _renormalised_restriction),
    "invalid-parents-kept": ("_next_parents", _all_drafts_valid),
}
