"""The draft tooling and the shipped default draft: small, documented, assembles with the target."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_dsbd import models, pairs
from vllm_dsbd.draft import DEFAULT_DIR, distill, prompts, student, teacher, train

MAX_SHIPPED_BYTES = 30 * 1000 * 1000


def test_shipped_draft_is_small_and_documented():
    """Weights + config + provenance + eval.json ship, under 30 MB, with the issue's keys."""
    files = {p.name: p.stat().st_size for p in DEFAULT_DIR.iterdir() if p.is_file()}
    assert {student.WEIGHTS, student.CONFIG, "provenance.json", "eval.json"} <= set(files)
    assert sum(files.values()) <= MAX_SHIPPED_BYTES, files
    prov = json.loads((DEFAULT_DIR / "provenance.json").read_text())
    assert {"command", "seed", "data", "training", "machine"} <= set(prov)
    assert prov["command"].startswith("vllm-dsbd distill-draft ")
    result = json.loads((DEFAULT_DIR / "eval.json").read_text())
    for key in ("alpha_t1", "alpha_t07", "greedy_agreement", "cost_ratio"):
        assert 0.0 < result[key] < 1.0, (key, result[key])


def test_eval_prompts_were_not_trained_on():
    """No held-out evaluation prompt is among the prompts the shipped draft was trained on."""
    prov = json.loads((DEFAULT_DIR / "provenance.json").read_text())
    trained = teacher.shard_prompts(prov["data"]["shards"], prov["seed"], prov["data"]["seqs_per_shard"])
    trained = {p for shard in trained for p in shard}
    assert len(trained) >= prov["data"]["shards"] * prov["data"]["seqs_per_shard"] // 2
    assert not trained & set(prompts.EVAL_PROMPTS)


def test_training_prompts_grow_by_appending():
    """More shards never change the prompts of earlier shards (resumed teacher runs stay consistent)."""
    assert teacher.shard_prompts(3, 0, 16)[:2] == teacher.shard_prompts(2, 0, 16)
    assert teacher.shard_prompts(2, 0, 16) != teacher.shard_prompts(2, 1, 16)


def test_topk_kl_is_zero_at_the_teacher_and_positive_elsewhere():
    """The distillation loss vanishes when q = p and grows when q moves away."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    top_logp, top_ids = logits.log_softmax(-1).topk(8, dim=-1)
    assert train.topk_kl(logits, top_ids, top_logp).item() == pytest.approx(0.0, abs=1e-5)
    assert train.topk_kl(logits.flip(-1), top_ids, top_logp).item() > 0.1


def test_top_k_of_position_takes_ranks_one_to_k_whether_or_not_the_sample_is_among_them():
    """vLLM lists the sampled token first; it is dropped as an extra and kept once inside the top k."""
    # sampled token 7 outside the top 3: 4 entries
    assert teacher.top_k_of_position([7, 3, 1, 2], [-9.0, -0.1, -1.0, -2.0], [40, 1, 2, 3], 3) == (
        [3, 1, 2], [-0.1, -1.0, -2.0])
    # sampled token 1 is rank 2: listed twice
    assert teacher.top_k_of_position([1, 3, 1, 2], [-1.0, -0.1, -1.0, -2.0], [2, 1, 2, 3], 3) == (
        [3, 1, 2], [-0.1, -1.0, -2.0])
    with pytest.raises(ValueError):
        teacher.top_k_of_position([3, 1], [-0.1, -1.0], [1, 2], 3)


def test_each_shard_is_trained_on_window_times():
    """Round r covers shards r-window+1..r, every row once per round, in a seeded order."""
    lengths = [[50, 60, 70], [80, 90], [100, 10, 20], [30]]
    seen: dict[tuple[int, int], int] = {}
    for r in range(len(lengths)):
        batches = train.round_batches(r, 2, lengths, seed=0, batch_tokens=100)
        assert batches == train.round_batches(r, 2, lengths, seed=0, batch_tokens=100)
        for item in (x for b in batches for x in b):
            seen[item] = seen.get(item, 0) + 1
    assert all(seen[(s, j)] == (1 if s == 3 else 2) for s in range(4) for j in range(len(lengths[s])))


def _fake_shards(data_dir, num_shards: int, seqs: int, vocab: int, k: int = 8) -> None:
    """Teacher shards with made-up distributions (for the training loop, not for quality)."""
    g = torch.Generator().manual_seed(1)
    data_dir.mkdir(parents=True)
    for i in range(num_shards):
        rows = []
        for _ in range(seqs):
            n = int(torch.randint(3, 9, (1,), generator=g))
            logp = (torch.randn(n, vocab, generator=g) * 2).log_softmax(-1)
            top_logp, top_ids = logp.topk(k, -1)
            rows.append({"prompt": torch.randint(0, vocab, (5,), generator=g).tolist(),
                         "answer": torch.randint(0, vocab, (n,), generator=g).tolist(),
                         "top_ids": top_ids.int(), "top_logp": top_logp.half()})
        torch.save({"index": i, "seed": 0, "num_tokens": sum(len(r["answer"]) for r in rows), "rows": rows},
                   teacher.shard_path(data_dir, i))


def _distill_args(tmp_path, target, *extra):
    from vllm_dsbd.cli import build_parser

    return build_parser().parse_args([
        "distill-draft", "--target", str(target), "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path),
        "--stage", "train", "--layers", "1", "--hidden", "64", "--head-rank", "4", "--seqs-per-shard", "4",
        "--top-k", "8", "--window", "2", "--batch-tokens", "16", "--tokens", "50", *extra])


def test_training_resumes_to_the_same_weights(tmp_path, tiny_pair):
    """Stopping after round 1 and resuming gives exactly the weights of an uninterrupted run."""
    full = _distill_args(tmp_path / "a", tiny_pair.target)
    target, data_dir, _ = distill.paths(full)
    _fake_shards(data_dir, 4, 4, vocab=49152)
    tokens = [teacher.shard_tokens(data_dir, i) for i in range(4)]
    expected_rounds = next(i + 1 for i in range(4) if sum(tokens[: i + 1]) >= 50)

    def run(args):
        train.train(args, *distill.paths(args))
        return torch.load(train.latest_checkpoint(distill.paths(args)[2]), weights_only=False)

    a = run(full)
    assert a["round"] == expected_rounds and a["step"] > expected_rounds
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / data_dir.name).symlink_to(data_dir)
    part = run(_distill_args(tmp_path / "b", tiny_pair.target, "--stop-after", "1"))
    assert part["round"] == 1
    b = run(_distill_args(tmp_path / "b", tiny_pair.target))
    assert b["round"] == a["round"] and b["step"] == a["step"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    other_lr = _distill_args(tmp_path / "b", tiny_pair.target, "--lr", "0.5")
    with pytest.raises(ValueError, match="other settings"):
        train.train(other_lr, *distill.paths(other_lr))


@pytest.fixture(scope="module")
def draft_path(target_path):
    """The default draft assembled from the shipped weights and the target (`models prepare`)."""
    return pairs.prepare().draft


@pytest.mark.model
def test_draft_assembles_as_llama_with_the_target_vocabulary(target_path, draft_path):
    """The assembled draft is a plain Llama with the target's vocabulary, tokenizer and embedding."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    assert draft_path == models.default_draft_path()
    t, d = AutoConfig.from_pretrained(target_path), AutoConfig.from_pretrained(draft_path)
    meta = json.loads((DEFAULT_DIR / student.CONFIG).read_text())
    assert d.model_type == "llama" and d.num_hidden_layers == meta["num_hidden_layers"]
    assert d.vocab_size == t.vocab_size == 49152 and not d.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(draft_path).get_vocab() == AutoTokenizer.from_pretrained(target_path).get_vocab()
    with safe_open(str(draft_path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (49152, t.hidden_size)
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), student.target_embedding(target_path))
    assert models.is_complete(draft_path, checksums=True)
