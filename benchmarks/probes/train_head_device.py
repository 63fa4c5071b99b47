"""``train-drafter --device``: a check and a throughput projection for training a head on a GPU.

Not a test (CI has no GPU): run by hand where torch sees a CUDA device,
``python -m benchmarks.probes.train_head_device --out DIR``. It needs no vLLM and no
prepared model: both targets are random-weight Llamas built here.

- **check**: the same run on the CPU and on the GPU, from the same start, on
  the tiny target: target features that agree to bf16 rounding, the first
  step's loss alike, both losses falling, a GPU checkpoint that loads and
  exports on the CPU with weights near the CPU run's.
- **projection**: tokens per second of the train stage's two parts (the
  target's features, the head's optimiser steps at 1 and 2 unrolled steps) on
  a target of SmolLM2-135M's shape with teacher rows of the real shards' mean
  lengths. Random weights cost what trained ones do, so the rates are the
  real recipe's; the losses are meaningless.

Writes ``DIR/train_head_device.json``; ``--plot`` draws it with this CPU's
recorded rates (``benchmarks/results/head-ab``) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from vllm_dsbd.draft import eagle3_head, teacher

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, max_position_embeddings=8192)
TINY_SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
# The default pair's 15 teacher shards: 1,576,136 answer tokens in 7,680 rows (205 a row); prompts about 60.
PROMPT_LEN, ANSWER_LEN, TEACHER_ANSWER_TOKENS = 60, 205, 1_576_136
RECORDS = Path(__file__).parent / "results" / "head-ab"


def random_target(out: Path, shape: dict, seed: int = 0) -> Path:
    """A random-weight Llama of ``shape``, without a tokenizer: ``models.build_tiny_llama`` needs the SmolLM2
    tokenizer from its registry package, which a bare GPU machine lacks, and training reads only ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return out


def fake_shards(data_dir: Path, shards: int, rows: int, prompt_len: int, answer_len: int, vocab: int) -> Path:
    """Teacher shards of random rows (answers from the lowest ids, so a draft vocabulary covers them); the tests'
    ``fake_teacher_shards`` with row lengths and vocabulary as arguments (shipped code does not import tests/)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for s in range(shards):
        shard = [{"prompt": torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
                  "answer": torch.randint(0, vocab // 4, (answer_len,), generator=gen).tolist()} for _ in range(rows)]
        torch.save({"index": s, "seed": 0, "num_tokens": answer_len * rows, "rows": shard},
                   teacher.shard_path(data_dir, s))
    return data_dir


def check(work: Path, steps: int, device: str) -> dict:
    target = random_target(work / "tiny", TINY_SHAPE)
    settings = eagle3_head.HeadSettings(aux_ids=(0, 1, 2), draft_vocab_size=512, ttt_steps=2, batch_tokens=256,
                                        tokens=256 * steps, lr=1e-3, warmup=2)
    runs, features = {}, {}
    for name, on in (("cpu", "cpu"), ("gpu", device)):
        data = fake_shards(work / f"data-{name}", 2, 24, 20, 60, TINY_SHAPE["vocab_size"])
        runs[name] = eagle3_head.train(settings, target, data, work / f"ckpt-{name}", progress=False, device=on)
        stored = eagle3_head.feature_dir(data, settings.aux_ids, settings.max_len)
        features[name] = torch.load(stored / "features-00000.pt", weights_only=True)
    loss = {d: [row["loss"] for row in runs[d]["log"]] for d in runs}
    weights = {d: torch.cat([v.flatten().float() for v in runs[d]["model"].values()]) for d in runs}
    out = eagle3_head.export(settings, target, work / "ckpt-gpu", work / "head-gpu")
    result = {
        "feature_max_rel_diff": max(float((features["gpu"][k].float() - features["cpu"][k].float()).abs().max()
                                          / features["cpu"][k].float().abs().max()) for k in ("aux", "last")),
        "first_loss": {d: loss[d][0] for d in loss}, "last_loss": {d: loss[d][-1] for d in loss},
        "weights_rel_diff": float((weights["gpu"] - weights["cpu"]).norm() / weights["cpu"].norm()),
        "exported": sorted(p.name for p in out.iterdir()), "steps": steps,
    }
    result["ok"] = bool(result["feature_max_rel_diff"] < 2e-2
                        and abs(loss["gpu"][0] - loss["cpu"][0]) < 2e-2 * abs(loss["cpu"][0])
                        and all(loss[d][-1] < loss[d][0] for d in loss) and result["weights_rel_diff"] < 0.1
                        and "model.safetensors" in result["exported"])
    return result


def projection(work: Path, train_steps: int, rows: int, device: str) -> dict:
    target = random_target(work / "smollm2-shape", SMOLLM2_SHAPE)
    data = fake_shards(work / "data-shape", 1, rows, PROMPT_LEN, ANSWER_LEN, SMOLLM2_SHAPE["vocab_size"])
    teacher_rows = eagle3_head.training_rows(data, 768)
    started = time.monotonic()
    stored = eagle3_head.store_features(target, data, eagle3_head.default_aux_ids(30), 768, progress=False,
                                        device=device)
    _, feature_s = eagle3_head.stored_features(stored, 1)  # the forwards alone, as the CPU's records count them
    result = {"feature_tokens": sum(len(r["ids"]) for r in teacher_rows), "feature_seconds": feature_s,
              "feature_wall_seconds": round(time.monotonic() - started, 2)}
    result["feature_tok_s"] = round(result["feature_tokens"] / feature_s)
    result["feature_answer_tok_s"] = round(rows * ANSWER_LEN / feature_s)
    for ttt in (1, 2):
        settings = eagle3_head.HeadSettings(aux_ids=eagle3_head.default_aux_ids(30), ttt_steps=ttt, fc_norm=True,
                                            batch_tokens=1024, tokens=1024 * (train_steps + 5), lr=5e-4)
        ckpt = work / f"ckpt-shape-ttt{ttt}"
        eagle3_head.train(settings, target, data, ckpt, stop_after=5, progress=False, device=device)  # warm-up
        before = eagle3_head.load_checkpoint(ckpt)
        after = eagle3_head.train(settings, target, data, ckpt, progress=False, device=device)
        seconds = after["seconds"] - before["seconds"]  # the optimiser steps alone, as the CPU's records count them
        tokens = after["tokens_seen"] - before["tokens_seen"]
        result[f"train_ttt{ttt}"] = {"tokens": tokens, "steps": after["step"] - before["step"],
                                     "seconds": round(seconds, 2), "tok_s": round(tokens / seconds)}
    return result


def this_cpu() -> dict:
    """This project's CPU's rates, in answer tokens per second, from the records of the seventh head (one unrolled
    step) and the eighth (two; its features of all 15 teacher shards)."""
    one, two = (json.loads((RECORDS / f"{name}-training.json").read_text()) for name in ("fcnorm-8m", "ttt2-from7"))
    return {"machine": "AMD EPYC, 2 cores (records of 2026-11-27)",
            "feature_answer_tok_s": round(TEACHER_ANSWER_TOKENS / two["feature_seconds"]),
            "train_ttt1_tok_s": round(one["tokens_seen"] / one["train_seconds"]),
            "train_ttt2_tok_s": round(two["tokens_seen"] / two["train_seconds"])}


def plot(result_path: Path) -> Path:
    """Tokens per second on the GPU against this CPU's recorded rates (``benchmarks/results/head-ab``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(result_path.read_text())
    cpu = this_cpu()
    gpu = result["projection"]
    labels = ["target features", "head, 1 unrolled step", "head, 2 unrolled steps"]
    cpu_rates = [cpu["feature_answer_tok_s"], cpu["train_ttt1_tok_s"], cpu["train_ttt2_tok_s"]]
    gpu_rates = [gpu["feature_answer_tok_s"], gpu["train_ttt1"]["tok_s"], gpu["train_ttt2"]["tok_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], cpu_rates, 0.4, label=cpu["machine"])
    ax.bar([i + 0.2 for i in x], gpu_rates, 0.4, label=result["machine"]["gpu"])
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("answer tokens / s (log)")
    ax.set_title("train-drafter's train stage, default pair's shapes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = result_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the JSON")
    p.add_argument("--work", default=None, help="folder for the models and runs (default: OUT/work; about 1 GB)")
    p.add_argument("--check-steps", type=int, default=20)
    p.add_argument("--train-steps", type=int, default=60, help="timed optimiser steps per unrolled-step count")
    p.add_argument("--rows", type=int, default=512, help="teacher rows of the projection (one shard's: 512)")
    p.add_argument("--device", default="cuda", help="the device checked against the CPU (cpu: a dry run)")
    p.add_argument("--plot", action="store_true", help="only draw DIR/train_head_device.json (no GPU needed)")
    args = p.parse_args()
    out = Path(args.out)
    if args.plot:
        print(plot(out / "train_head_device.json"))
        return
    work = Path(args.work) if args.work else out / "work"
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "none (dry run)"
    result = {"machine": {"gpu": gpu, "cpu_cores": os.cpu_count(), "torch": torch.__version__}}
    result["check"] = check(work, args.check_steps, args.device)
    print(json.dumps(result["check"]), flush=True)
    result["projection"] = projection(work, args.train_steps, args.rows, args.device)
    result["this_cpu"] = this_cpu()
    (out / "train_head_device.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
