"""Training an EAGLE-3 head for a target on CPU (``vllm-dsbd train-drafter``), with the speculators library.

The head is speculators' own ``Eagle3DraftModel`` (one Llama decoder layer,
``fc`` over three aux hidden states of the target, the target's lm_head rows of
a draft vocabulary), trained with its own loss (KL to the target's distribution
over the draft vocabulary) and unrolled draft steps ("training-time test"), and
saved in its checkpoint format, which vLLM and vllm-dsbd load. What this module
adds is what speculators does through a GPU data pipeline: the target's
features computed here with Hugging Face transformers, once, and stored beside
the teacher shards (bf16, one file per shard), and a small resumable CPU
training loop over them. Data: the target's own answers (``draft.teacher``
shards, made with vLLM).

Rows follow DSBD's layout (docs/dev/eagle3-internals.md): row p holds token p and the
feature of position p - 1 (zeros at p = 0), at position p, and learns the
target's distribution after token p. speculators' ``shift_batch`` layout is the
same without the position-0 row.

speculators 0.9.0 is installed with ``--no-deps`` (scripts/setup.sh): its
declared torchvision / torchaudio would replace the CPU torch. On CPU it needs
``sdpa`` attention (its flex attention has no CPU backward) and the eager loss
(the default fused loss is a Triton kernel).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch

from vllm_dsbd.draft import teacher

ATTENTION = "sdpa"
CHECKPOINT = "head-checkpoint.pt"


class Refused(ValueError):
    """A run or a head refused before it trains or measures: the message names the flag or folder and what is
    allowed or what to do (``vllm-dsbd train-drafter`` and ``eval-head`` print it as one error line)."""


@dataclass(frozen=True)
class HeadSettings:
    """What shapes a training run; a resumed run must have the same."""

    aux_ids: tuple[int, ...]
    draft_vocab_size: int = 8192
    ttt_steps: int = 3  # unrolled draft steps (>= the γ to use)
    lr: float = 1e-3
    warmup: int = 20
    batch_tokens: int = 2048  # about, per optimiser step (whole sequences)
    max_len: int = 768  # tokens of prompt + answer kept per sequence
    tokens: int = 500_000  # answer tokens to train on (passes over the data as needed)
    seed: int = 0
    bf16: bool = True  # bf16 autocast (fp32 weights and optimiser)
    num_layers: int = 1  # decoder layers of the head (the first takes [embedding, feature]; vLLM runs any number)
    teacher_temperature: float = 1.0  # of the teacher's answers it trains on (0: the target's greedy answers)
    fc_norm: bool = False  # an RMSNorm on each aux state before ``fc`` (speculators' and vLLM's ``fc_norm``)
    from_pretrained: str = ""  # an exported head whose weights and draft vocabulary the run starts from
    teacher_dtype: str = "float32"  # the target's dtype writing the teacher answers (draft.teacher.TeacherConfig)
    features_dtype: str = "float32"  # the target's dtype computing its features (FEATURE_DTYPES; stored in bf16)
    shards: int = 0  # teacher shards 0..shards-1 it trains on (0: every shard in the teacher folder)


_DEFAULTS = {f.name: f.default for f in fields(HeadSettings) if f.default is not MISSING}
"""What a checkpoint of an older version, which did not record a setting, was trained with."""


def default_aux_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default (2, L // 2, L - 3), or (0, L // 2, L) for targets too shallow for it."""
    ids = (2, num_layers // 2, num_layers - 3)
    return ids if num_layers >= 6 else (0, num_layers // 2, num_layers)


def _speculators():
    try:
        import speculators  # noqa: F401
    except ImportError as e:
        raise RuntimeError("training EAGLE-3 heads needs the speculators library: "
                           "pip install --no-deps speculators==0.9.0 (scripts/setup.sh does)") from e


def draft_vocabulary(rows: list[dict], vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the ``size`` most frequent tokens of the answers (speculators' rule)."""
    _speculators()
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(torch.as_tensor(r["answer"], dtype=torch.long), minlength=vocab_size)
    freq = {i: int(c) for i, c in enumerate(counts.tolist()) if c}
    return build_vocab_mappings_from_distribution(freq, size, vocab_size)


def head_config(head_dir: Path, flag: str) -> dict:
    """The config of the head ``flag`` names, refused unless an EAGLE-3 head in speculators format."""
    try:
        config = json.loads((Path(head_dir) / "config.json").read_text())
    except FileNotFoundError:
        raise Refused(f"{flag} {head_dir}: no config.json; allowed: a head train-drafter exported "
                      "(speculators format)") from None
    if config.get("speculators_model_type") != "eagle3":
        raise Refused(f"{flag} {head_dir}: not an EAGLE-3 head in speculators format "
                      f"(speculators_model_type {config.get('speculators_model_type')!r})")
    return config


def pretrained_head(head_dir: Path, settings: HeadSettings) -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
    """(weights, d2t, t2d, its training.json) of an exported head to start a run from (speculators'
    ``--from-pretrained``), refused naming each setting of ``settings`` it was not built with."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    config = head_config(head_dir, "--from-pretrained")
    has = {"--aux-layers": tuple(sorted(config["eagle_aux_hidden_state_layer_ids"])),
           "--draft-vocab-size": config["draft_vocab_size"],
           "--head-layers": config["transformer_layer_config"]["num_hidden_layers"],
           "--fc-norm": bool(config.get("fc_norm", False))}
    asked = {"--aux-layers": tuple(sorted(settings.aux_ids)), "--draft-vocab-size": settings.draft_vocab_size,
             "--head-layers": settings.num_layers, "--fc-norm": settings.fc_norm}
    wrong = [f"{k} is {asked[k]} but the head has {has[k]}" for k in has if has[k] != asked[k]]
    if wrong:
        raise Refused(f"--from-pretrained {head_dir}: " + "; ".join(wrong) + " (train with the head's settings)")
    weights = load_file(str(head_dir / "model.safetensors"))
    d2t, t2d = weights.pop("d2t"), weights.pop("t2d")
    training = head_dir / "training.json"
    return ({k: v.float() for k, v in weights.items()}, d2t, t2d,
            json.loads(training.read_text()) if training.exists() else {})


def _load_pretrained(head, weights: dict, names: set[str], head_dir: str) -> None:
    """Every trainable weight of ``head`` from ``weights``, refused naming a missing or misshapen one."""
    own = head.state_dict()
    missing = sorted(names - weights.keys())
    shapes = [f"{k} {tuple(weights[k].shape)} (this target: {tuple(own[k].shape)})"
              for k in sorted(names & weights.keys()) if weights[k].shape != own[k].shape]
    if missing or shapes:
        raise Refused(f"--from-pretrained {head_dir} does not fit this target's head: "
                      + "; ".join(([f"no {', '.join(missing)}"] if missing else []) + shapes))
    head.load_state_dict({k: weights[k] for k in names}, strict=False)


def build_head(target_dir: Path, settings: HeadSettings, d2t: torch.Tensor, t2d: torch.Tensor):
    """speculators' Eagle3DraftModel for the target, its frozen parts (embeddings, lm_head rows) from the target."""
    _speculators()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, LlamaConfig

    target = AutoConfig.from_pretrained(target_dir)
    layer = LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=settings.num_layers, num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads,
        hidden_act=target.hidden_act, max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps, tie_word_embeddings=False, attention_bias=False)
    rope = dict(getattr(target, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    rope.pop("partial_rotary_factor", None)
    layer.rope_parameters = rope
    layer._attn_implementation = ATTENTION  # before the model is built; not saved
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=settings.draft_vocab_size, norm_before_residual=False,
        fc_norm=settings.fc_norm,
        eagle_aux_hidden_state_layer_ids=list(settings.aux_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=settings.ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target_dir), architectures=list(target.architectures or []))))
    torch.manual_seed(settings.seed)
    head = Eagle3DraftModel(config)
    head.load_vocab_mappings(t2d, d2t)
    head.load_verifier_weights()  # embed_tokens, lm_head (rows of t2d), final norm, from the target's safetensors
    return head


class TargetFeatures:
    """The target's aux hidden states (vLLM's ids: id i is the residual stream entering layer i, id L the last
    layer's output before the final norm) and its last pre-norm state, from Hugging Face transformers."""

    def __init__(self, target_dir: Path, aux_ids: tuple[int, ...], device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=FEATURE_DTYPES[dtype]).to(device).eval()
        self.aux_ids = tuple(sorted(set(aux_ids)))  # vLLM exports them in ascending order
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        layers = self.model.model.layers
        captured = {}
        hook = layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("last", o[0] if isinstance(o, tuple)
                                                                                    else o))
        try:  # the base model: no logits over the whole vocabulary
            out = self.model.model(torch.tensor([ids], device=self.device), output_hidden_states=True)
        finally:
            hook.remove()
        last = captured["last"][0]
        aux = [last if i == len(layers) else out.hidden_states[i][0] for i in self.aux_ids]
        return torch.cat(aux, dim=-1), last


FEATURE_DTYPE = torch.bfloat16  # what the head's bf16 autocast would make of them anyway
FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes the target may compute the features in (``--features-dtype``): bf16 is about 2.5-3x faster on a
CPU with native bf16, and it is what the engine's target computes there (docs/dev/eagle3-internals.md)."""


def _store_prefix(dtype: str) -> str:
    """Feature stores' names start with this (float32: the name older versions used)."""
    return "features-aux" if dtype == "float32" else "features-bf16-aux"


def feature_dir(data_dir: Path, aux_ids: tuple[int, ...], max_len: int, dtype: str = "float32") -> Path:
    """Where the features of the teacher rows in ``data_dir`` are stored, per aux layers, row length and the
    dtype the target computed them in."""
    return Path(data_dir) / f"{_store_prefix(dtype)}{'-'.join(map(str, sorted(set(aux_ids))))}-len{max_len}"


def _feature_path(out: Path, index: int) -> Path:
    return out / f"features-{index:05d}.pt"


def _shard_rows(data_dir: Path, index: int, max_len: int) -> list[dict]:
    rows = []
    for r in torch.load(teacher.shard_path(data_dir, index), weights_only=False)["rows"]:
        ids = (list(r["prompt"]) + list(r["answer"]))[:max_len]
        if len(ids) > len(r["prompt"]):
            rows.append({"ids": ids, "prompt_len": len(r["prompt"]), "answer": r["answer"]})
    return rows


def store_features(target_dir: Path, data_dir: Path, aux_ids: tuple[int, ...], max_len: int,
                   progress: bool = True, device: str = "cpu", dtype: str = "float32",
                   num_shards: int | None = None) -> Path:
    """The target's features of every teacher row, computed once: one file per teacher shard (``aux`` and
    ``last`` of all its rows, concatenated, in ``FEATURE_DTYPE``), so a stopped run resumes at the next shard
    and shards the teacher adds later are computed when training next starts (``num_shards``: of shards
    0..num_shards-1 only; default every shard in ``data_dir``)."""
    from tqdm import tqdm

    out = feature_dir(data_dir, aux_ids, max_len, dtype)
    out.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(num_shards or teacher.num_shards(data_dir)) if not _feature_path(out, i).exists()]
    if not todo:
        return out
    layers = json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"]
    features = None
    for i in tqdm(todo, desc="target features", unit="shard", disable=not progress):
        shard = _derived_features(data_dir, out, i, aux_ids, layers, dtype)
        if shard is None:
            features = features or TargetFeatures(target_dir, aux_ids, device, dtype)
            started = time.monotonic()
            rows = _shard_rows(data_dir, i, max_len)
            pieces = [features(r["ids"]) for r in rows]
            shard = {"lengths": [len(r["ids"]) for r in rows],
                     "aux": torch.cat([a for a, _ in pieces]).to("cpu", FEATURE_DTYPE),
                     "last": torch.cat([b for _, b in pieces]).to("cpu", FEATURE_DTYPE),
                     "seconds": round(time.monotonic() - started, 1)}
        tmp = _feature_path(out, i).with_suffix(".tmp")  # written whole or not at all: a stop resumes here
        torch.save(shard, tmp)
        tmp.replace(_feature_path(out, i))
    return out


def _derived_features(data_dir: Path, out: Path, index: int, aux_ids: tuple[int, ...], layers: int,
                      dtype: str = "float32") -> dict | None:
    """Shard ``index``'s features for ``aux_ids``, cut from another store of the same rows and dtype that holds
    every id they name (id ``layers``, the last layer's output, is every store's ``last``), or None if none
    does. Its ``seconds`` are the source's: what computing these features cost."""
    want, prefix = sorted(set(aux_ids)), _store_prefix(dtype)
    for other in sorted(Path(data_dir).glob(f"{prefix}*-{out.name.rsplit('-', 1)[-1]}")):
        ids = [int(x) for x in other.name[len(prefix):].rsplit("-", 1)[0].split("-")]
        if other == out or not _feature_path(other, index).exists() or not set(want) <= {*ids, layers}:
            continue
        shard = torch.load(_feature_path(other, index), mmap=True, weights_only=True)
        hidden = shard["last"].shape[-1]
        columns = [shard["last"] if i not in ids else shard["aux"][:, ids.index(i) * hidden:(ids.index(i) + 1) * hidden]
                   for i in want]
        return {"lengths": shard["lengths"], "aux": torch.cat(columns, dim=-1), "last": shard["last"].clone(),
                "seconds": shard["seconds"]}
    return None


def stored_features(out: Path, num_shards: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """(aux, last) per teacher row, in ``training_rows`` order, as views of the memory-mapped shard files; and
    the seconds it took to compute them."""
    per_row, seconds = [], 0.0
    for i in range(num_shards):
        shard = torch.load(_feature_path(out, i), mmap=True, weights_only=True)
        seconds += shard["seconds"]
        starts = [0]
        for n in shard["lengths"]:
            starts.append(starts[-1] + n)
        per_row += [(shard["aux"][a:b], shard["last"][a:b]) for a, b in zip(starts, starts[1:])]
    return per_row, seconds


def example(ids: list[int], prompt_len: int, aux: torch.Tensor, last: torch.Tensor) -> dict:
    """One training row in DSBD's layout (a batch of one, as speculators' forward takes)."""
    n = len(ids)
    features = torch.cat([aux.new_zeros((1, aux.shape[-1])), aux[:-1]])  # row p: the feature of p - 1
    mask = torch.zeros(n, dtype=torch.bool)
    mask[max(prompt_len - 1, 0):] = True  # rows whose next token is an answer token (and the one after)
    return {"input_ids": torch.tensor([ids]), "hidden_states": features[None], "verifier_last_hidden_states": last[None],
            "loss_mask": mask[None], "position_ids": torch.arange(n)[None],
            "document_ids": torch.zeros((1, n), dtype=torch.long)}


def training_shards(data_dir: Path, shards: int) -> int:
    """How many teacher shards a run trains on: ``shards`` (``HeadSettings.shards``; 0: every shard in
    ``data_dir``), refused while the teacher has not written them."""
    present = teacher.num_shards(data_dir)
    if not present:
        raise Refused(f"no teacher shards in {data_dir}: run the 'teach' stage first")
    if present < shards:
        raise Refused(f"--shards {shards}: {present} teacher shards in {data_dir}; run the 'teach' stage with "
                      f"--shards {shards} first")
    return shards or present


def training_rows(data_dir: Path, max_len: int, num_shards: int | None = None) -> list[dict]:
    """Every (prompt, answer) row of the teacher shards in ``data_dir`` (``num_shards``: of shards
    0..num_shards-1), in shard order, cut to ``max_len``."""
    rows = [r for i in range(num_shards or teacher.num_shards(data_dir)) for r in _shard_rows(data_dir, i, max_len)]
    if not rows:
        raise Refused(f"no teacher shards in {data_dir}: run the 'teach' stage first")
    return rows


def _lr(settings: HeadSettings, step: int, total: int) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    frac = min(1.0, (step - settings.warmup) / max(1, total - settings.warmup))
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def training_device(name: str) -> str:
    """``--device``, refused naming the devices this machine has unless torch can train on it."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    allowed = ["cpu", *(["cuda", *(f"cuda:{i}" for i in range(gpus))] if gpus else [])]
    if name not in allowed:
        raise Refused(f"--device {name}: not a device torch can train on here; allowed: {', '.join(allowed)}"
                      + ("" if gpus else " (no CUDA device found)"))
    return name


def train(settings: HeadSettings, target_dir: Path, data_dir: Path, ckpt_dir: Path, stop_after: int | None = None,
          progress: bool = True, device: str = "cpu") -> dict:
    """Train (or resume) until ``settings.tokens`` answer tokens (``stop_after``: at most that many optimiser steps
    in this call); a checkpoint every 10 steps and at the end. Returns the final checkpoint. Each step's log row
    has its token-weighted loss and the mean first-to-last unrolled step top-1 accuracy."""
    from speculators.losses import resolve_loss_config
    from tqdm import tqdm

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / CHECKPOINT
    num_shards = training_shards(data_dir, settings.shards)
    rows = training_rows(data_dir, settings.max_len, num_shards)
    stored = store_features(target_dir, data_dir, settings.aux_ids, settings.max_len, progress, device,
                            settings.features_dtype, num_shards)
    row_features, feature_seconds = stored_features(stored, num_shards)
    if [len(r["ids"]) for r in rows] != [len(aux) for aux, _ in row_features]:
        raise Refused(f"the stored features in {stored} do not match the teacher rows in {data_dir}; "
                      "delete that folder to compute them again")
    state = load_checkpoint(ckpt_dir) if path.exists() else None
    if state is not None and {**_DEFAULTS, **state["settings"]} != asdict(settings):
        raise Refused(f"{path} was trained with other settings {state['settings']}; use another --work-dir")
    vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
    start, started_from = None, state.get("started_from") if state is not None else None
    if state is not None:
        d2t, t2d = state["d2t"], state["t2d"]
    elif settings.from_pretrained:
        start, d2t, t2d, started_from = pretrained_head(Path(settings.from_pretrained), settings)
    else:
        d2t, t2d = draft_vocabulary(rows, vocab, settings.draft_vocab_size)
    head = build_head(target_dir, settings, d2t, t2d)
    trainable = [p for p in head.parameters() if p.requires_grad]
    trainable_names = {n for n, p in head.named_parameters() if p.requires_grad}
    if start is not None:
        _load_pretrained(head, start, trainable_names, settings.from_pretrained)
    head.to(device)
    opt = torch.optim.AdamW(trainable, lr=settings.lr)
    step, cursor, seen, seconds = 0, 0, 0, 0.0
    if state is not None:
        head.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step, cursor, seen, seconds = state["step"], state["cursor"], state["tokens_seen"], state["seconds"]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    loss_config = resolve_loss_config("kl_div", "eager")
    total_steps = max(1, settings.tokens // settings.batch_tokens)
    log = list(state["log"]) if state is not None else []
    bar = tqdm(total=settings.tokens, initial=seen, desc="train head", unit="tok", unit_scale=True, disable=not progress)

    def save():
        tmp = path.with_suffix(".tmp")
        torch.save({"settings": asdict(settings), "step": step, "cursor": cursor, "tokens_seen": seen,
                    "seconds": round(seconds + time.monotonic() - started, 1),
                    "feature_seconds": feature_seconds, "d2t": d2t,
                    "t2d": t2d, "model": {k: v.cpu() for k, v in head.state_dict().items() if k in trainable_names},
                    "optimizer": opt.state_dict(), "log": log, "started_from": started_from}, tmp)
        tmp.replace(path)

    head.train()
    steps_run, started = 0, time.monotonic()
    while seen < settings.tokens and (stop_after is None or steps_run < stop_after):
        for group in opt.param_groups:
            group["lr"] = _lr(settings, step, total_steps)
        batch, batch_tokens = [], 0
        while batch_tokens < settings.batch_tokens:
            index = order[cursor % len(rows)]
            r = rows[index]
            cursor += 1
            batch.append((index, r))
            batch_tokens += len(r["ids"]) - r["prompt_len"]
        opt.zero_grad()
        sums, batch_loss = torch.zeros(settings.ttt_steps), 0.0
        for index, r in batch:
            aux, last = (f.to(device, torch.float32) for f in row_features[index])
            inputs = {k: v.to(device) for k, v in example(r["ids"], r["prompt_len"], aux, last).items()}
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=settings.bf16):
                _, loss, metrics = head(**inputs, ttt_steps=settings.ttt_steps,
                                        ttt_step_loss_decay=0.8, loss_config=loss_config)
            weighted = loss * (len(r["ids"]) - r["prompt_len"]) / batch_tokens
            weighted.backward()
            batch_loss += float(weighted)
            sums += torch.tensor([float(metrics[f"full_acc_{k}_sum"] / metrics[f"full_acc_{k}_total"].clamp_min(1))
                                  for k in range(settings.ttt_steps)])
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step, steps_run, seen = step + 1, steps_run + 1, seen + batch_tokens
        log.append({"step": step, "tokens": seen, "loss": round(batch_loss, 4),
                    "acc": [round(float(a), 4) for a in sums / len(batch)]})
        bar.update(batch_tokens)
        bar.set_postfix(loss=f"{batch_loss:.3f}", acc1=f"{float(sums[0]) / len(batch):.3f}")
        if step % 10 == 0:
            save()
    save()
    bar.close()
    return load_checkpoint(ckpt_dir)


def load_checkpoint(ckpt_dir: Path) -> dict:
    """A run's checkpoint, its tensors on the CPU whichever device trained it (``train``'s ``device``)."""
    return torch.load(Path(ckpt_dir) / CHECKPOINT, map_location="cpu", weights_only=False)


def export(settings: HeadSettings, target_dir: Path, ckpt_dir: Path, out_dir: Path, verifier_name: str | None = None,
           dtype: torch.dtype = torch.bfloat16) -> Path:
    """The trained head in speculators' format, without the target's embeddings (vLLM shares them), and
    ``training.json`` (settings, tokens, steps, training seconds, the last log rows)."""
    state = load_checkpoint(ckpt_dir)
    head = build_head(target_dir, settings, state["d2t"], state["t2d"])
    head.load_state_dict(state["model"], strict=False)
    if verifier_name:
        head.config.speculators_config.verifier.name_or_path = verifier_name
    weights = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in head.state_dict().items()
               if k != "embed_tokens.weight" and not k.startswith("verifier_")}
    out_dir = Path(out_dir)
    head.save_pretrained(out_dir, state_dict=weights)
    config = json.loads((out_dir / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("auto_map", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "config.py").unlink(missing_ok=True)
    training = {"settings": {**_DEFAULTS, **state["settings"]}, "steps": state["step"], "tokens_seen": state["tokens_seen"],
                "train_seconds": state["seconds"], "feature_seconds": state.get("feature_seconds"),
                "last_log_rows": state["log"][-10:]}
    if state.get("started_from") is not None:  # the training.json of the head it started from
        training["started_from"] = state["started_from"]
    (out_dir / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    return out_dir
