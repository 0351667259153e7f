"""Can cuDNN's fused attention run a cached prefix of any length without a plan per length?

cuDNN builds an execution plan per new shape (~120 ms on an H100), which is why the split prefill
attention is opt-in. Its ragged entry (`_cudnn_attention_forward` with cumulative sequence
lengths) takes the true lengths as device tensors beside maximum lengths that size the plan; if
the plan is keyed on the maxima, lengths bucketed to a few maxima reuse a few plans. This probe:

  1. ragged cuDNN, unmasked prefix part (query heads folded per KV head), against float64;
     the layout of its log-sum-exp
  2. flash attention's own entry on the causal square (native GQA, [1, n, heads, dim]) against
     float64, and bottom-right alignment when the query is shorter than the keys
  3. first-call wall time: a new length inside a seen bucket vs a new bucket
  4. TFLOP/s of the ragged prefix part at 512 x 7,680 beside the dense cuDNN call

Usage (GPU machine): python benchmarks/gpu_ragged_probe.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

HEADS, KV_HEADS, DIM = 32, 8, 128
GROUP = HEADS // KV_HEADS
ops = torch.ops.aten


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None):
    """q [n, h, d], k/v [m, kvh, d] -> out [n, h, d], lse [h, n] in float64; causal_offset:
    query i sees keys <= i + offset (None: all)."""
    n, m = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(causal_offset + 1)
        s = s.masked_fill(mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, -1) @ vv).transpose(0, 1), lse


def ragged_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_q: int, max_k: int):
    """Unmasked prefix part through the ragged cuDNN entry, heads folded: returns (out [n, h, d],
    lse [h, n]) unfolded, plus the raw lse's shape."""
    n = q.shape[0]
    rows = GROUP * n
    folded = q.view(n, KV_HEADS, GROUP, DIM).permute(2, 0, 1, 3).reshape(rows, KV_HEADS, DIM)
    cum_q = torch.tensor([0, rows], dtype=torch.int32, device=q.device)
    cum_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    res = ops._cudnn_attention_forward(
        folded,
        k,
        v,
        None,
        cum_q,
        cum_k,
        max_q,
        max_k,
        True,
        0.0,
        False,
        False,
        scale=1 / math.sqrt(DIM),
    )
    out, lse = res[0], res[1]
    raw = (tuple(out.shape), tuple(lse.shape), tuple(lse.stride()))
    out = out.view(GROUP, n, KV_HEADS, DIM).permute(1, 2, 0, 3).reshape(n, HEADS, DIM)
    lse_flat = lse.reshape(-1)
    if lse.shape[0] == KV_HEADS or (lse.dim() == 3 and lse.shape[1] == KV_HEADS):
        lse_h = lse.reshape(KV_HEADS, GROUP, n)
    else:  # [rows, kv_heads]
        lse_h = lse_flat.view(rows, KV_HEADS).t().reshape(KV_HEADS, GROUP, n)
    return out, lse_h.reshape(HEADS, n), raw


def flash_square(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    res = ops._flash_attention_forward(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        None,
        None,
        q.shape[0],
        k.shape[0],
        0.0,
        True,
        False,
        scale=1 / math.sqrt(DIM),
    )
    return res[0][0], res[1][0]


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def event_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version()}
    print(res)
    # 1. ragged prefix part vs float64
    try:
        n, p = 300, 5000
        q, k, v = rand(n, HEADS, DIM), rand(p, KV_HEADS, DIM), rand(p, KV_HEADS, DIM)
        out, lse, raw = ragged_prefix(q, k, v, 2048, 8192)
        ref_out, ref_lse = reference(q, k, v, None)
        res["ragged_raw_shapes"] = raw
        res["ragged_out_err"] = (out.double() - ref_out).abs().max().item()
        res["ragged_lse_err"] = (lse.double() - ref_lse).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        res["ragged_error"] = repr(exc)[:500]
    print(res)
    # 2. flash on the causal square and bottom-right alignment
    try:
        n = 300
        q, k, v = rand(n, HEADS, DIM), rand(n, KV_HEADS, DIM), rand(n, KV_HEADS, DIM)
        out, lse = flash_square(q, k, v)
        ref_out, ref_lse = reference(q, k, v, 0)
        res["flash_square_shapes"] = (tuple(out.shape), tuple(lse.shape))
        res["flash_square_out_err"] = (out.double() - ref_out).abs().max().item()
        res["flash_square_lse_err"] = (lse.double() - ref_lse).abs().max().item()
        k2, v2 = rand(n + 700, KV_HEADS, DIM), rand(n + 700, KV_HEADS, DIM)
        out2, _ = flash_square(q, k2, v2)
        br, _ = reference(q, k2, v2, 700)
        tl, _ = reference(q, k2, v2, 0)
        res["flash_bottom_right_err"] = (out2.double() - br).abs().max().item()
        res["flash_top_left_err"] = (out2.double() - tl).abs().max().item()
    except Exception as exc:  # noqa: BLE001
        res["flash_error"] = repr(exc)[:500]
    print(res)
    # 3. plan reuse
    if "ragged_error" not in res:
        kbig, vbig = rand(17000, KV_HEADS, DIM), rand(17000, KV_HEADS, DIM)
        times = []
        for n, p, mq, mk in [
            (512, 7680, 2048, 8192),
            (512, 7680, 2048, 8192),
            (500, 7000, 2048, 8192),
            (400, 6500, 2048, 8192),
            (130, 7999, 2048, 8192),
            (512, 4000, 2048, 4096),
            (512, 3000, 2048, 4096),
            (512, 16000, 2048, 16384),
            (100, 2000, 512, 2048),
            (90, 1900, 512, 2048),
            (512, 7680, 2048, 8192),
        ]:
            q = rand(n, HEADS, DIM)
            ms = wall_ms(
                lambda q=q, p=p, mq=mq, mk=mk: ragged_prefix(q, kbig[:p], vbig[:p], mq, mk)
            )
            times.append({"n": n, "prefix": p, "max_q": mq, "max_k": mk, "first_ms": round(ms, 2)})
        res["ragged_first_call"] = times
        print(times)
        # dense cuDNN on new shapes, for contrast
        dense = []
        for n, p in [(512, 7680), (500, 7000), (400, 6500)]:
            qf = rand(1, KV_HEADS, GROUP * n, DIM)
            kk = kbig[:p].transpose(0, 1).unsqueeze(0)
            vv = vbig[:p].transpose(0, 1).unsqueeze(0)
            ms = wall_ms(
                lambda qf=qf, kk=kk, vv=vv: ops._scaled_dot_product_cudnn_attention(
                    qf, kk, vv, None, True
                )
            )
            dense.append({"n": n, "prefix": p, "first_ms": round(ms, 2)})
        res["dense_first_call"] = dense
        print(dense)
        # 4. speed at 512 x 7680
        n, p = 512, 7680
        flops = 4 * HEADS * DIM * n * p
        q = rand(n, HEADS, DIM)
        for mk in (8192, 16384):
            ms = event_ms(lambda mk=mk: ragged_prefix(q, kbig[:p], vbig[:p], 2048, mk))
            res[f"ragged_512x7680_maxk{mk}_us"] = ms * 1e3
            res[f"ragged_512x7680_maxk{mk}_tflops"] = flops / ms / 1e9
        qf = rand(1, KV_HEADS, GROUP * n, DIM)
        kk, vv = kbig[:p].transpose(0, 1).unsqueeze(0), vbig[:p].transpose(0, 1).unsqueeze(0)
        ms = event_ms(lambda: ops._scaled_dot_product_cudnn_attention(qf, kk, vv, None, True))
        res["dense_512x7680_us"] = ms * 1e3
        res["dense_512x7680_tflops"] = flops / ms / 1e9
        ks, vs = kbig[:n], vbig[:n]
        ms = event_ms(lambda: flash_square(q, ks, vs))
        res["flash_square_512_us"] = ms * 1e3
        print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
