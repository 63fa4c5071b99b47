"""The cost of an EAGLE-3 head's weights in one draft layer, by matrix-multiply backend.

In-step drafting (``draft_in_step``) runs the head once per draft layer over a few rows (W to a few times W),
right after the target's forward has evicted the head's weights from the caches. This times the projections of
one such call (q, k, v, o, gate, up, down and the draft-vocabulary ``lm_head``; not ``fc``, which only layer 1's
chain rows take) over ``M`` rows, the caches flushed before each call, with:

- ``onednn-float32`` / ``onednn-bfloat16``: vLLM's CPU path for an unquantized linear (``onednn_mm`` over a
  packed weight), where the CPU supports the dtype;
- ``fbgemm-int8``: torch's dynamic int8 quantization (int8 weights per tensor, activations quantized per call);
- ``int8pack``: torch's int8 weight-only matmul (``_weight_int8pack_mm``, per-channel scales).

The int8 rows also report the largest logit error of the ``lm_head`` against float32 (int8 would change the
head's distribution q; verification stays exact, as it uses the q the draft drew from, but q's quality drops).

    python -m benchmarks.probes.bench_head_gemm --out benchmarks/results/head-gemm

Writes ``head_gemm.json`` and ``head_gemm.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.machine import machine_facts

LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")
FLUSH_BYTES = 256 << 20


def head_weights(head_dir: str) -> dict[str, torch.Tensor]:
    """The per-layer projections and the lm_head of a speculators-format head, in float32."""
    from safetensors import safe_open

    with safe_open(str(Path(head_dir) / "model.safetensors"), "pt") as f:
        names = [f"layers.0.{n}.weight" for n in LAYER] + ["lm_head.weight"]
        return {n: f.get_tensor(n).float() for n in names}


def backends(weights: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """name -> (input dtype, linear(name, x)), for each backend this machine can build."""
    import vllm._custom_ops as ops

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        try:
            handles = {n: ops.create_onednn_mm(w.to(dtype).t(), 32) for n, w in weights.items()}
        except RuntimeError:  # oneDNN has no kernel for this dtype on this CPU (bf16 without avx512_bf16)
            continue
        out[f"onednn-{str(dtype)[6:]}"] = (dtype, lambda n, x, h=handles: ops.onednn_mm(h[n], x, None))
    with warnings.catch_warnings():  # torch.ao's quantization is deprecated (it still runs)
        warnings.simplefilter("ignore")
        quantized = {}
        for n, w in weights.items():
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight.data = w
            quantized[n] = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                                  dtype=torch.qint8)
    out["fbgemm-int8"] = (torch.float32, lambda n, x: quantized[n](x))
    scales = {n: w.abs().amax(1) / 127 for n, w in weights.items()}
    packed = {n: torch.round(w / scales[n][:, None]).clamp(-127, 127).to(torch.int8) for n, w in weights.items()}
    out["int8pack"] = (torch.float32, lambda n, x: torch._weight_int8pack_mm(x, packed[n], scales[n]))
    return out


def time_call(linear, weights: dict[str, torch.Tensor], rows: int, dtype: torch.dtype, repeats: int) -> float:
    """Median ms of one layer's projections over ``rows`` rows, the caches flushed before each."""
    flush = torch.zeros(FLUSH_BYTES // 4)
    inputs = {n: torch.randn(rows, w.shape[1]).to(dtype) for n, w in weights.items()}
    times = []
    for _ in range(repeats):
        flush.add_(1.0)
        start = time.perf_counter()
        for n, x in inputs.items():
            linear(n, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default="vllm_dsbd/draft/default-head")
    parser.add_argument("--rows", default="4,8,16,32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/head-gemm")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = head_weights(args.head)
    rows = [int(r) for r in args.rows.split(",")]
    probe = torch.randn(8, weights["lm_head.weight"].shape[1])
    reference = F.linear(probe, weights["lm_head.weight"])
    result = {"machine": machine_facts(), "head": args.head, "threads": args.threads,
              "weight_mb_float32": sum(w.numel() for w in weights.values()) * 4 / 1e6, "backends": {}}
    for name, (dtype, linear) in backends(weights).items():
        ms = {r: time_call(linear, weights, r, dtype, args.repeats) for r in rows}
        error = (linear("lm_head.weight", probe.to(dtype)).float() - reference).abs().max().item()
        result["backends"][name] = {"ms_by_rows": ms, "lm_head_max_logit_error": error}
        print(f"{name:16s} " + "  ".join(f"M {r}: {t:6.2f} ms" for r, t in ms.items())
              + f"  lm_head max error {error:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_gemm.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "head_gemm.png")


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in result["backends"].items():
        rows = [int(r) for r in row["ms_by_rows"]]
        ax.plot(rows, list(row["ms_by_rows"].values()), marker="o", label=name)
    ax.set_xlabel("rows in the call")
    ax.set_ylabel("ms per draft layer (projections, cold caches)")
    ax.set_title(f"{result['machine']['cpu']}, {result['threads']} threads", fontsize=9)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
