"""Distillation: fit the student's next-token distribution q to the target's p.

Loss per answer position (forward KL over the teacher's top-k ids plus one
bucket for the rest of the vocabulary):

    KL = sum_{v in top-k} p_v (log p_v - log q_v) + p_rest (log p_rest - log q_rest)

Schedule: round ``r`` trains on the sequences of shards ``r - window + 1 .. r``
(each shard is seen ``window`` times, in consecutive rounds), shuffled
with a seeded RNG and cut into batches of about ``batch_tokens`` answer
tokens. Training stops after the round whose shard brings the teacher data to
``tokens`` answer tokens. AdamW, linear warm-up, cosine decay to 10 % over
``window x tokens`` trained tokens, gradient clipping 1.0. The schedule is a
pure function of the arguments and the shards, so training may run while the
teacher stage is still writing shards (a round waits for its shard) and
resumes from any checkpoint to the same result.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch

from vllm_dsbd.draft import student as student_mod
from vllm_dsbd.draft import teacher

# Arguments that change the training result: resuming with other values is refused.
SCHEDULE_ARGS = ("layers", "head_rank", "tokens", "seed", "seqs_per_shard", "max_new_tokens", "top_k",
                 "window", "batch_tokens", "lr", "warmup")


def round_batches(r: int, window: int, lengths: list[list[int]], seed: int, batch_tokens: int):
    """Batches of round ``r`` as lists of (shard, row), given every shard's answer lengths."""
    items = [(s, j) for s in range(max(0, r - window + 1), r + 1) for j in range(len(lengths[s]))]
    random.Random(seed * 7919 + r).shuffle(items)
    batches, cur, n = [], [], 0
    for s, j in items:
        cur.append((s, j))
        n += lengths[s][j]
        if n >= batch_tokens:
            batches.append(cur)
            cur, n = [], 0
    if cur:
        batches.append(cur)
    return batches


def collate(rows: list[dict], pad_id: int):
    """Right-padded inputs and the teacher targets at answer positions.

    Returns input_ids [b, t], attention_mask [b, t], the (batch, time) indices
    of the answer positions [n] and [n], top_ids [n, k] and top_logp [n, k].
    The answer's last token is never an input: nothing follows it.
    """
    seqs = [r["prompt"] + r["answer"][:-1] for r in rows]
    t = max(len(s) for s in seqs)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    bi, ti = [], []
    for i, (s, r) in enumerate(zip(seqs, rows)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        p = len(r["prompt"])
        bi += [i] * len(r["answer"])
        ti += list(range(p - 1, p - 1 + len(r["answer"])))  # position p-1 predicts answer[0]
    top_ids = torch.cat([r["top_ids"] for r in rows]).long()
    top_logp = torch.cat([r["top_logp"] for r in rows]).float()
    return ids, mask, torch.tensor(bi), torch.tensor(ti), top_ids, top_logp


def topk_kl(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p || q) over positions; p known on top-k ids plus a rest bucket.

    logits [n, V] (student), top_ids [n, k], top_logp [n, k] (teacher log-probs).
    """
    logq = logits.float().log_softmax(-1)
    logq_top = logq.gather(-1, top_ids)  # [n, k]
    p_top = top_logp.exp()
    p_rest = (1.0 - p_top.sum(-1)).clamp(min=1e-6)  # [n]
    q_rest = (1.0 - logq_top.exp().sum(-1)).clamp(min=1e-6)
    kl = (p_top * (top_logp - logq_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    return kl.mean()


class Shards:
    """Teacher shards on demand: waits for shards the teacher stage has not written yet."""

    def __init__(self, data_dir: Path, keep: int, poll_s: float = 10.0):
        self.data_dir, self.keep, self.poll_s = Path(data_dir), keep, poll_s
        self.rows: dict[int, list[dict]] = {}
        self.lengths: list[list[int]] = []  # answer lengths of shards 0..len-1
        self.tokens: list[int] = []
        self.waited_s = 0.0  # time spent waiting for the teacher (not training time)

    def get(self, i: int) -> list[dict]:
        if i not in self.rows:
            path = teacher.shard_path(self.data_dir, i)
            if not path.exists():
                print(f"waiting for {path} (run the teach stage)", flush=True)
            t0 = time.time()
            while not path.exists():
                time.sleep(self.poll_s)
            self.waited_s += time.time() - t0
            self.rows[i] = torch.load(path)["rows"]
            for old in [k for k in self.rows if k < i - self.keep]:
                del self.rows[old]
        return self.rows[i]

    def lengths_upto(self, r: int) -> list[list[int]]:
        while len(self.lengths) <= r:
            lens = [len(x["answer"]) for x in self.get(len(self.lengths))]
            self.lengths.append(lens)
            self.tokens.append(sum(lens))
        return self.lengths


def lr_at(frac: float, step: int, base: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``base`` to ``base / 10`` as frac goes 0 -> 1."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    cks = sorted(Path(ckpt_dir).glob("step-*.pt"))
    return cks[-1] if cks else None


def _plain_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}


def build_student(target_dir: Path, layers: int, head_rank: int):
    """A fresh student initialised from the target; returns (student, pad id)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model = student_mod.Student.from_target(target, layers, head_rank)
    cfg = target.config
    return model, cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id


def train(args, target_dir: Path, data_dir: Path, ckpt_dir: Path) -> None:
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    model, pad_id = build_student(target_dir, args.layers, args.head_rank)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step, start_round, trained_tokens, log, elapsed0 = 0, 0, 0, [], 0.0
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        ck = torch.load(latest, weights_only=False)  # our own checkpoint
        changed = {k: (v, getattr(args, k, None)) for k, v in ck["args"].items()
                   if k in SCHEDULE_ARGS and getattr(args, k, None) != v}
        if changed:
            raise ValueError(f"{ckpt_dir} was trained with other settings {changed}; use another --work-dir")
        student_mod.load_trainable(model, ck["model"])
        opt.load_state_dict(ck["opt"])
        step, start_round, trained_tokens, log = ck["step"], ck["round"], ck["trained_tokens"], ck["log"]
        elapsed0 = ck["elapsed"]
        print(f"resumed from {latest} (step {step}, round {start_round})", flush=True)

    shards = Shards(data_dir, keep=args.window)
    planned = args.window * args.tokens  # trained tokens the LR schedule spans

    def done_before(r: int) -> bool:
        """Whether shards 0..r-1 already hold the teacher token budget (so round r is not run)."""
        if r == 0:
            return False
        shards.lengths_upto(r - 1)
        return sum(shards.tokens[:r]) >= args.tokens

    t0 = time.time()

    def elapsed() -> float:
        """Training seconds so far, over all resumed runs, without waiting for teacher shards."""
        return elapsed0 + time.time() - t0 - shards.waited_s

    def save(round_done: int) -> None:
        path = ckpt_dir / f"step-{step:07d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model.trainable_state(), "opt": opt.state_dict(), "step": step,
                    "round": round_done, "trained_tokens": trained_tokens, "log": log,
                    "elapsed": elapsed(), "args": _plain_args(args),
                    "command": "vllm-dsbd " + " ".join(sys.argv[1:]), "threads": torch.get_num_threads(),
                    "shard_tokens": shards.tokens[:round_done]}, tmp)
        tmp.replace(path)
        for old in sorted(ckpt_dir.glob("step-*.pt"))[:-2]:
            old.unlink()

    saved_round = start_round
    model.train()
    bar = tqdm(total=planned, initial=trained_tokens, desc="distill", unit="tok", unit_scale=True)
    ema = None
    r = start_round
    while not done_before(r) and (args.stop_after is None or r < args.stop_after):
        batches = round_batches(r, args.window, shards.lengths_upto(r), args.seed, args.batch_tokens)
        for batch in batches:
            rows = [shards.get(s)[j] for s, j in batch]
            ids, mask, bi, ti, top_ids, top_logp = collate(rows, pad_id)
            h = model.hidden(ids, mask)[bi, ti]  # [n, H] answer positions only
            loss = topk_kl(model.logits(h), top_ids, top_logp)
            for g in opt.param_groups:
                g["lr"] = lr_at(trained_tokens / planned, step, args.lr, args.warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            trained_tokens += len(bi)
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            bar.update(len(bi))
            bar.set_postfix(kl=f"{ema:.3f}", round=r, step=step)
            if step % 10 == 0:
                log.append({"step": step, "round": r, "tokens": trained_tokens, "kl_ema": round(ema, 4),
                            "sec": round(elapsed(), 1)})
        r += 1
        if r % max(1, args.ckpt_every) == 0:
            save(r)
            saved_round = r
    if saved_round != r:
        save(r)
    bar.close()


def export(args, target_dir: Path, ckpt_dir: Path, out_dir: Path) -> dict:
    """Write the shippable draft from the latest checkpoint; returns the checkpoint (for provenance)."""
    from transformers import AutoConfig

    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}: run the train stage first")
    ck = torch.load(latest, weights_only=False)  # our own checkpoint
    model = student_mod.Student(AutoConfig.from_pretrained(target_dir), args.layers, args.head_rank)
    student_mod.load_trainable(model, ck["model"])
    student_mod.save_shipped(model, Path(out_dir))
    return ck
