"""The DSBD algorithm on plain torch tensors (imports nothing from vLLM).

- :mod:`.joint` — one beam step: tempered log-probs, the joint ``P(b, v) ∝
  exp(S_b) p_T(v | x_b)`` over a group's live beams with top-k/top-p on the
  joint, inverse-CDF sampling from explicit generators, and vLLM's
  beam-search step (``T = 0``). Batched over groups with masks.
- :mod:`.verify` — verification of a draft forest: per-layer multi-draft
  rejection with residuals, the acceptance-count dynamic program and the
  width rule, the whole iteration (:func:`verify_forest`).
- :mod:`.draft_columns` — a layer verified over a draft's own K columns
  (and each parent's target mass outside them) instead of all V.
- :mod:`.verify_greedy` — lossless speculative beam search (``T = 0``,
  :func:`verify_forest_greedy`).
- :mod:`.forest` — a group's forest as nodes and as root-to-leaf paths (the
  form the engine runs through the target), with each node's owning position.
- :mod:`.reference` — exact beam sampling, vLLM's beam search, and a complete
  reference DSBD decoder over logits functions.
- :mod:`.mjsd` — MJSD (seed 004): the joint-likelihood acceptance rule of a
  draft path and an exact reference decoder; the engine runs it through
  ``engine.mjsd_step`` (``decoder: "mjsd"``).
- :mod:`.toy` — small random Markov models to test with.

docs/algorithm.md is the contract; each module's docstring lists
the decisions it makes where the contract leaves room.
"""

from vllm_dsbd.algorithm.forest import (
    Forest,
    ForestPaths,
    ancestor_mask,
    build_forest,
    gather_node_rows,
    root_to_leaf_paths,
)
from vllm_dsbd.algorithm.joint import (
    PROB_FLOOR,
    BeamSearchStep,
    Generators,
    beam_search_score,
    beam_search_step,
    finishing_tokens,
    token_finishes,
    joint_logprobs,
    joint_probs,
    probs_from_logprobs_,
    restrict_joint,
    sample_from_uniforms,
    sample_joint,
    tempered_logprobs,
    uniforms,
)
from vllm_dsbd.algorithm.reference import (
    DecodeParams,
    DecodeResult,
    Hypothesis,
    LogitsFn,
    beam_sampling,
    beam_search,
    dsbd_decode,
)
from vllm_dsbd.algorithm.verify import (
    ForestVerification,
    LayerVerification,
    acceptance_count_distribution,
    choose_width,
    residual_ladder,
    restrict_to_parents,
    verify_forest,
    verify_layer,
)
from vllm_dsbd.algorithm.verify_greedy import GreedyForestVerification, verify_forest_greedy

__all__ = [
    "PROB_FLOOR",
    "BeamSearchStep",
    "DecodeParams",
    "DecodeResult",
    "Forest",
    "ForestPaths",
    "ForestVerification",
    "Generators",
    "GreedyForestVerification",
    "Hypothesis",
    "LayerVerification",
    "LogitsFn",
    "acceptance_count_distribution",
    "ancestor_mask",
    "beam_sampling",
    "beam_search",
    "beam_search_score",
    "beam_search_step",
    "finishing_tokens",
    "token_finishes",
    "build_forest",
    "choose_width",
    "dsbd_decode",
    "gather_node_rows",
    "joint_logprobs",
    "joint_probs",
    "probs_from_logprobs_",
    "residual_ladder",
    "restrict_joint",
    "restrict_to_parents",
    "root_to_leaf_paths",
    "sample_from_uniforms",
    "sample_joint",
    "tempered_logprobs",
    "uniforms",
    "verify_forest",
    "verify_forest_greedy",
    "verify_layer",
]
