"""GPU benchmarks of the model runner, each figure beside its ceiling from the same run.

Llama-3-8B shape, random bf16 weights, one GPU:
  * prefill of an 8K prompt: model TFLOP/s vs the measured bf16 matmul rate, and vs Hugging Face
    transformers (sdpa attention) on the same weights (views of ours, see gpu_hf.py), each
    timed back to back and both again called in turn (`alternated_ms`)
  * prefill with 7.5K of 8K tokens cached: TTFT vs cold
  * decode, batch 32 at 2K context: tokens/s vs transformers' eager `generate`, the host reading
    each step's tokens before the next step, or beside it (fed on the device)
  * the paged decode kernel's K/V read bandwidth vs the measured HBM copy rate
TTFT here is the runner's forward (host planning included, synchronised), not the service's.

Usage (on the GPU machine): python benchmarks/gpu_runner.py --json $OUT/gpu_runner.json \
    [--profile-dir $OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_hf import hf_llama_sharing_weights  # type: ignore[import-not-found]
from gpu_kernel import (  # type: ignore[import-not-found]
    cached_prefill_attention_report,
    decode_kernel_report,
    measure_ceilings,
)

from kvmesh.workers.model.batch_plan import AttentionMode
from kvmesh.workers.model.cudnn_pages import PagesBucket, cudnn_pages_usable
from kvmesh.workers.model.model_config import ModelConfig, preset
from kvmesh.workers.model.runner import ModelRunner, SeqChunk

PROMPT_LEN, CACHED_LEN = 8192, 7680
DECODE_BATCH, DECODE_CTX, DECODE_STEPS = 32, 2048, 32
TRITON = AttentionMode(paged_decode=True, paged_prefill=True, explicit_masks=False)
GATHER = AttentionMode(paged_decode=False, paged_prefill=False, explicit_masks=False)
SPLIT = AttentionMode(
    paged_decode=True, paged_prefill=False, explicit_masks=False, split_prefill=True
)
BUCKETED = AttentionMode(
    paged_decode=True, paged_prefill=True, explicit_masks=False, bucketed_prefill=True
)
CUDNN_PAGES = dataclasses.replace(BUCKETED, cudnn_pages=True)
NEW_LENGTHS = 24


def wall_ms(fn: Callable[[], object], warmup: int = 2, reps: int = 5) -> float:
    """Median wall time of fn, synchronised: what a caller waiting for the result sees."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def alternated_ms(fns: dict[str, Callable[[], object]], reps: int = 5) -> dict[str, float]:
    """Median wall time of each fn, called in turn rep after rep (one warm-up round): each sees
    the card's clocks and temperature as the others do, where back to back the later ones would
    run on a card the earlier ones heated."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def prefill_flops(c: ModelConfig, start: int, end: int) -> float:
    """Model FLOPs of prefilling positions [start, end): matmuls, attention, one LM-head row."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token = (
        2
        * c.num_layers
        * (c.hidden_size * (2 * q_dim + 2 * kv_dim) + 3 * c.hidden_size * c.intermediate_size)
    )
    pairs = sum(range(start + 1, end + 1))  # query at position p sees p + 1 keys
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * pairs
    return per_token * (end - start) + attention + 2 * c.hidden_size * c.vocab_size


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def bench_prefill(runner: ModelRunner, hf: Any, peak_tflops: float) -> dict[str, Any]:
    c = runner.config
    ids = random_ids(PROMPT_LEN, c.vocab_size, 1)
    table = list(range(PROMPT_LEN // runner.block_size))
    cold_ms = wall_ms(lambda: runner.forward([SeqChunk(ids, 0, table)]))
    runner.fused_elementwise = False
    cold_torch_elementwise_ms = wall_ms(lambda: runner.forward([SeqChunk(ids, 0, table)]))
    runner.fused_elementwise, runner.fused_kv_write = True, False
    cold_kv_write_apart_ms = wall_ms(lambda: runner.forward([SeqChunk(ids, 0, table)]))
    runner.fused_kv_write = True
    gated = runner.gated_matmul

    def cold_gate_apart() -> None:  # SiLU x up by cuBLAS + silu_mul, not in the matmul
        runner.gated_matmul = False
        runner.forward([SeqChunk(ids, 0, table)])
        runner.gated_matmul = gated

    cold_gate_apart_ms = wall_ms(cold_gate_apart)
    hf_ids = torch.tensor([ids], device=runner.device)
    with torch.inference_mode():
        hf_ms = wall_ms(lambda: hf(input_ids=hf_ids, use_cache=True, logits_to_keep=1), reps=3)
        alternated = alternated_ms(
            {
                "ours": lambda: runner.forward([SeqChunk(ids, 0, table)]),
                "ours_gate_apart": cold_gate_apart,
                "hf_sdpa": lambda: hf(input_ids=hf_ids, use_cache=True, logits_to_keep=1),
            }
        )
    runner.forward([SeqChunk(ids[:CACHED_LEN], 0, table)])
    suffix = SeqChunk(ids[CACHED_LEN:], CACHED_LEN, table)
    cached = {}
    default = runner.attention.mode
    modes = [("triton", TRITON), ("gather+flash", GATHER), ("split", SPLIT), ("bucketed", BUCKETED)]
    first_modes = {"triton": TRITON, "bucketed": BUCKETED}
    if cudnn_pages_usable(runner.device):
        modes.append(("cudnn_pages", CUDNN_PAGES))
        first_modes["cudnn_pages"] = CUDNN_PAGES
    for name, mode in modes:
        runner.attention.mode = mode
        cached[name] = wall_ms(lambda: runner.forward([suffix]), warmup=3, reps=10)
    if "cudnn_pages" in first_modes:  # the same path without its CUDA graphs
        runner.attention.mode, runner.prefill_graphs = CUDNN_PAGES, False
        cached["cudnn_pages_eager"] = wall_ms(lambda: runner.forward([suffix]), warmup=3, reps=10)
        runner.prefill_graphs = True
    new_lengths = first_call_ms(runner, ids, table, first_modes)
    runner.attention.mode = default
    flops = prefill_flops(c, 0, PROMPT_LEN)
    return {
        "cold_ms": cold_ms,
        "cold_torch_elementwise_ms": cold_torch_elementwise_ms,
        "cold_kv_write_apart_ms": cold_kv_write_apart_ms,
        "gated_matmul": gated,
        "cold_gate_apart_ms": cold_gate_apart_ms,
        "hf_sdpa_ms": hf_ms,
        "speedup_vs_hf": hf_ms / cold_ms,
        "alternated_ms": alternated,
        "speedup_vs_hf_alternated": alternated["hf_sdpa"] / alternated["ours"],
        "model_tflops": flops / cold_ms / 1e9,
        "fraction_of_matmul_peak": flops / cold_ms / 1e9 / peak_tflops,
        "cached_ms": cached,
        "cached_flops": prefill_flops(c, CACHED_LEN, PROMPT_LEN),
        "ttft_ratio_cold_over_cached": cold_ms / cached["triton"],
        "ttft_ratio_gather_flash": cold_ms / cached["gather+flash"],
        "ttft_ratio_split": cold_ms / cached["split"],
        "ttft_ratio_bucketed": cold_ms / cached["bucketed"],
        "ttft_ratio_cudnn_pages": cold_ms / cached.get("cudnn_pages", float("nan")),
        "new_lengths_first_call_ms": new_lengths,
        "runner_default": (
            "cudnn_pages"
            if default.cudnn_pages
            else "bucketed"
            if default.bucketed_prefill
            else "triton"
        ),
    }


def first_call_ms(
    runner: ModelRunner, ids: list[int], table: list[int], modes: dict[str, AttentionMode]
) -> dict[str, dict[str, list[float]]]:
    """Wall time of a forward at NEW_LENGTHS (prefix, chunk) lengths not seen before (a server
    meets new ones all the time), the modes taking turns at each length; then the same lengths
    again ("seen"), then other new ones ("new_again"): what is paid once per length shows as
    the difference between the passes."""
    rng = random.Random(7)

    def lengths() -> list[SeqChunk]:
        chunks = []
        for _ in range(NEW_LENGTHS):
            prefix = rng.randrange(2048, PROMPT_LEN - 700)
            chunks.append(SeqChunk(ids[prefix : prefix + rng.randrange(16, 700)], prefix, table))
        return chunks

    first = lengths()
    passes = {"new": first, "seen": first, "new_again": lengths()}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in modes}
    for pass_name, chunks in passes.items():
        for name in modes:
            times[name][pass_name] = []
        for i, chunk in enumerate(chunks):
            for name in sorted(modes, reverse=bool(i % 2)):
                runner.attention.mode = modes[name]
                call = functools.partial(runner.forward, [chunk])
                times[name][pass_name].append(wall_ms(call, warmup=0, reps=1))
    return times


def decode_tables(first_block: int, block_size: int) -> list[list[int]]:
    per_seq = -(-(DECODE_CTX + DECODE_STEPS + 8) // block_size)
    return [
        list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
        for i in range(DECODE_BATCH)
    ]


def decode_steps(
    runner: ModelRunner, tables: list[list[int]], last: list[int]
) -> tuple[list[int], list[float]]:
    """DECODE_STEPS greedy steps, each step's tokens read on the host before the next is built
    (the host's whole turn between steps shows in each); final tokens and ms per step."""
    tokens, samples = list(last), []
    for step in range(DECODE_STEPS):
        pos = DECODE_CTX + step
        chunks = [SeqChunk([t], pos, tables[i]) for i, t in enumerate(tokens)]
        start = time.perf_counter()
        tokens = runner.forward(chunks).argmax(-1).tolist()
        samples.append((time.perf_counter() - start) * 1e3)
    return tokens, samples


def decode_steps_fed(
    runner: ModelRunner, tables: list[list[int]], last: list[int]
) -> tuple[list[int], list[float]]:
    """The same steps, each queued with the last one's tokens on the device before the host
    reads them (`forward_tokens`); ms per step, building the batch and reading the tokens
    included."""
    previous = runner.forward_tokens(
        [SeqChunk([t], DECODE_CTX, tables[i]) for i, t in enumerate(last)]
    )
    samples = []
    for step in range(1, DECODE_STEPS):
        start = time.perf_counter()
        chunks = [SeqChunk([0], DECODE_CTX + step, table) for table in tables]
        launched = runner.forward_tokens(chunks, previous=previous)
        previous.tolist()  # the last step's tokens, read while this one runs
        previous = launched
        samples.append((time.perf_counter() - start) * 1e3)
    return previous.tolist(), samples


def bench_decode(runner: ModelRunner, tables: list[list[int]]) -> dict[str, Any]:
    """Fill the cache by prefilling the prompts, then time greedy decode steps (tokens fed back,
    so every step includes the host round trip a real engine makes; "fed": that round trip
    runs beside the next step)."""
    c = runner.config
    prompts = [random_ids(DECODE_CTX, c.vocab_size, 100 + i) for i in range(DECODE_BATCH)]
    last: list[int] = []
    for i in range(0, DECODE_BATCH, 8):
        chunks = [SeqChunk(prompts[j], 0, tables[j]) for j in range(i, i + 8)]
        last += runner.forward(chunks).argmax(-1).tolist()
    results: dict[str, Any] = {}
    default, graphs, fused = runner.attention.mode, runner.cuda_graphs, runner.fused_elementwise
    for name, mode, use_graphs, use_fused, kv_write in (
        ("triton+graphs", TRITON, True, True, True),
        ("triton+graphs, fed on the device", TRITON, True, True, True),
        ("triton+graphs, K/V written apart", TRITON, True, True, False),
        ("triton+graphs, torch elementwise", TRITON, True, False, False),
        ("triton", TRITON, False, True, True),
        ("gather+sdpa", GATHER, False, True, True),
    ):
        runner.attention.mode, runner.cuda_graphs = mode, use_graphs
        runner.fused_elementwise, runner.fused_kv_write = use_fused, kv_write
        steps = decode_steps_fed if name.endswith("fed on the device") else decode_steps
        tokens, samples = steps(runner, tables, last)
        step_ms = statistics.median(samples[3:])
        results[name] = {"step_ms": step_ms, "tokens_per_s": DECODE_BATCH / step_ms * 1e3}
        results[name]["tokens"] = tokens
    runner.attention.mode, runner.cuda_graphs = default, graphs
    runner.fused_elementwise, runner.fused_kv_write = fused, True
    final = {name: row.pop("tokens") for name, row in results.items()}
    results["graphs_same_tokens_as_eager"] = final["triton+graphs"] == final["triton"]
    results["fed_same_tokens_as_host_loop"] = (
        final["triton+graphs, fed on the device"] == final["triton+graphs"]
    )
    results["kv_write_same_tokens_as_apart"] = (
        final["triton+graphs"] == final["triton+graphs, K/V written apart"]
    )
    results["fused_same_tokens_as_torch"] = (
        final["triton+graphs"] == final["triton+graphs, torch elementwise"]
    )
    return results


def bench_hf_generate(hf: Any, vocab: int) -> dict[str, float]:
    """Eager `generate` (DynamicCache, no compile): decode time = (T(1 + n) - T(1)) / n."""
    ids = torch.randint(0, vocab, (DECODE_BATCH, DECODE_CTX), device=hf.device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> None:
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    with torch.inference_mode():
        generate(2)  # warm-up
        one = wall_ms(lambda: generate(1), warmup=0, reps=1)
        many = wall_ms(lambda: generate(1 + DECODE_STEPS), warmup=0, reps=1)
    step_ms = (many - one) / DECODE_STEPS
    return {"prefill_ms": one, "step_ms": step_ms, "tokens_per_s": DECODE_BATCH / step_ms * 1e3}


def attention_in_forward(runner: ModelRunner, *, scattered: bool = False) -> dict[str, Any]:
    """The cached-prefix attention as the hit's forward runs it (its CUDA graph where one is
    captured): the attention kernel's device time per layer from a profiler trace of 3 forwards,
    in TFLOP/s of the attention's FLOPs; beside it the same forward's wall time. The prompt's
    blocks in one ascending run (as a fresh pool hands them out: cuDNN reads them as longer
    pages) or `scattered` over the cache (one block a page)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    c = runner.config
    ids = random_ids(PROMPT_LEN, c.vocab_size, 3)
    used = PROMPT_LEN // runner.block_size
    table = list(range(used))
    if scattered:
        table = random.Random(3).sample(range(runner.num_blocks), used)
    bucket = PagesBucket.for_chunk(
        table, CACHED_LEN, PROMPT_LEN - CACHED_LEN, runner.block_size, runner.num_blocks
    )
    runner.forward([SeqChunk(ids[:CACHED_LEN], 0, table)])
    suffix = [SeqChunk(ids[CACHED_LEN:], CACHED_LEN, table)]
    wall = wall_ms(lambda: runner.forward(suffix), warmup=3, reps=10)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner.forward(suffix)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if "sdpa" in e.key or "attention" in e.key.lower()]
    count = sum(e.count for e in kernels)
    total_us = sum(e.self_device_time_total for e in kernels)
    per_layer_flops = 4 * c.num_heads * c.head_dim * sum(range(CACHED_LEN + 1, PROMPT_LEN + 1))
    per_call_us = total_us / count if count else float("nan")
    return {
        "block_size": runner.block_size,
        "page_tokens": runner.block_size * bucket.page_blocks,
        "forward_ms": wall,
        "kernels": sorted({e.key[:80] for e in kernels}),
        "calls": count,
        "per_layer_us": per_call_us,
        "tflops": per_layer_flops / (per_call_us * 1e-6) / 1e12 if count else float("nan"),
    }


def profile(runner: ModelRunner, fn: Callable[[], object], path: Path | None) -> str:
    """Kernel-time table of a few calls: where the time goes (the evidence for missed goals)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    try:
        table = averages.table(sort_by="self_device_time_total", row_limit=14)
    except (AttributeError, KeyError):  # older torch names device time after CUDA
        table = averages.table(sort_by="self_cuda_time_total", row_limit=14)
    if path is not None:
        path.write_text(table)
    return str(table)


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile-dir", type=Path, help="write profiler tables here")
    parser.add_argument("--quick", action="store_true", help="skip the kernel tile sweep")
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens a KV block (a page) holds"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {"device": props.name, "torch": torch.__version__}
    results["block_size"] = args.block_size
    results["ceilings"] = ceil = measure_ceilings()
    print("ceilings", json.dumps(ceil), flush=True)
    results["decode_kernel"] = decode_kernel_report(props.multi_processor_count, not args.quick)
    print("kernel", json.dumps(results["decode_kernel"]["goal_shape_default"]), flush=True)
    results["cached_attention"] = cached_prefill_attention_report(props.multi_processor_count)
    print("cached attention", json.dumps(results["cached_attention"]), flush=True)
    config = preset("llama3-8b-random")
    block_size = args.block_size
    first_decode_block = PROMPT_LEN // block_size
    tables = decode_tables(first_decode_block, block_size)
    num_blocks = tables[-1][-1] + 1
    runner = ModelRunner(config, num_blocks, block_size, device="cuda")
    started = time.perf_counter()
    shapes = runner.attention.warm_up_split(2048)  # what a worker does before it serves
    results["split_warm_up"] = {"shapes": shapes, "seconds": time.perf_counter() - started}
    hf = hf_llama_sharing_weights(runner)
    results["hf_check"] = check_against_hf(runner, hf)
    print("hf check", json.dumps(results["hf_check"]), flush=True)
    results["prefill"] = bench_prefill(runner, hf, ceil["matmul_bf16_tflops"])
    print("prefill", json.dumps(results["prefill"]), flush=True)
    for key, scattered in (
        ("attention_in_forward", False),
        ("attention_in_forward_scattered", True),
    ):
        results[key] = attention_in_forward(runner, scattered=scattered)
        print(key, json.dumps(results[key]), flush=True)
    results["decode"] = bench_decode(runner, tables)
    results["decode"]["hf_eager_generate"] = bench_hf_generate(hf, config.vocab_size)
    print("decode", json.dumps(results["decode"]), flush=True)
    results["profiles"] = run_profiles(runner, tables, args.profile_dir)
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def check_against_hf(runner: ModelRunner, hf: Any) -> dict[str, float]:
    """Last-token logits of one 512-token prompt from both models (bf16: close, not equal)."""
    ids = random_ids(512, runner.config.vocab_size, 7)
    ours = runner.forward([SeqChunk(ids, 0, list(range(32)))])[0]
    with torch.inference_mode():
        theirs = hf(input_ids=torch.tensor([ids], device=runner.device), logits_to_keep=1).logits
    theirs = theirs[0, -1].float()
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item()
    return {
        "cosine": cosine,
        "max_abs_diff": (ours - theirs).abs().max().item(),
        "max_abs": theirs.abs().max().item(),
        "same_argmax": float(ours.argmax().item() == theirs.argmax().item()),
    }


def run_profiles(runner: ModelRunner, tables: list[list[int]], out: Path | None) -> dict[str, str]:
    ids = random_ids(PROMPT_LEN, runner.config.vocab_size, 1)
    table = list(range(PROMPT_LEN // runner.block_size))
    suffix = [SeqChunk(ids[CACHED_LEN:], CACHED_LEN, table)]
    step = [SeqChunk([5], DECODE_CTX + DECODE_STEPS, t) for t in tables]
    tables_out = {}
    for name, fn in (
        ("cold_prefill_8k", lambda: runner.forward([SeqChunk(ids, 0, table)])),
        ("cached_prefill_7.5k_of_8k", lambda: runner.forward(suffix)),
        ("decode_step_b32_2k", lambda: runner.forward(step)),
    ):
        path = out / f"profile_{name}.txt" if out else None
        tables_out[name] = profile(runner, fn, path)
        print(f"--- profile {name}\n{tables_out[name]}", flush=True)
    return tables_out


def table_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(benchmark, measured, goal) rows of the summary table."""
    c, p, d, a = r["ceilings"], r["prefill"], r["decode"], r["cached_attention"]
    k = r["decode_kernel"]["goal_shape_default"]
    kb = r["decode_kernel"]["goal_shape_best"]
    hf_dec = d["hf_eager_generate"]
    rows = [
        ("ceiling: bf16 matmul", f"{c['matmul_bf16_tflops']:.0f} TFLOP/s", ""),
        ("ceiling: HBM copy (read+write)", f"{c['hbm_copy_gbps']:.0f} GB/s", ""),
        (
            "ceiling: causal SDPA 8K (GQA / MHA)",
            f"{c['sdpa_causal_8k_gqa_tflops']:.0f} / {c['sdpa_causal_8k_mha_tflops']:.0f} TFLOP/s",
            "",
        ),
        (
            "prefill 8K cold",
            f"{p['cold_ms']:.1f} ms = {p['model_tflops']:.0f} TFLOP/s "
            f"({100 * p['fraction_of_matmul_peak']:.0f}% of matmul)",
            ">= 50%",
        ),
        (
            "prefill 8K cold, torch elementwise ops",
            f"{p['cold_torch_elementwise_ms']:.1f} ms",
            "",
        ),
        (
            "prefill 8K cold, K/V written apart from RoPE",
            f"{p['cold_kv_write_apart_ms']:.1f} ms",
            "",
        ),
        (
            "prefill 8K cold, SiLU x up apart from the gate/up matmul",
            f"{p['cold_gate_apart_ms']:.1f} ms (the matmul's epilogue "
            f"{'used' if p['gated_matmul'] else 'not usable here'})",
            "",
        ),
        (
            "prefill 8K, HF sdpa",
            f"{p['hf_sdpa_ms']:.1f} ms (ours {p['speedup_vs_hf']:.2f}x faster)",
            "> 1x",
        ),
        (
            "prefill 8K cold, ours / SiLU x up apart / HF sdpa called in turn",
            f"{p['alternated_ms']['ours']:.1f} / {p['alternated_ms']['ours_gate_apart']:.1f} / "
            f"{p['alternated_ms']['hf_sdpa']:.1f} ms ({p['speedup_vs_hf_alternated']:.2f}x)",
            ">= 1.25x",
        ),
        (
            "prefill 7.5K/8K cached (triton)",
            f"{p['cached_ms']['triton']:.1f} ms: "
            f"{p['ttft_ratio_cold_over_cached']:.1f}x lower TTFT",
            "",
        ),
        (
            "prefill 7.5K/8K cached (bucketed split, cuDNN + flash)",
            f"{p['cached_ms']['bucketed']:.1f} ms: {p['ttft_ratio_bucketed']:.1f}x lower TTFT",
            ">= 12x",
        ),
        (
            "prefill 7.5K/8K cached (cuDNN reading the pages)",
            f"{p['cached_ms'].get('cudnn_pages', float('nan')):.1f} ms: "
            f"{p['ttft_ratio_cudnn_pages']:.1f}x lower TTFT (CUDA graph; eager "
            f"{p['cached_ms'].get('cudnn_pages_eager', float('nan')):.1f} ms)",
            ">= 12x",
        ),
        (
            "prefill 7.5K/8K cached (exact split)",
            f"{p['cached_ms']['split']:.1f} ms: {p['ttft_ratio_split']:.1f}x lower TTFT",
            "",
        ),
        (
            "split warm-up before serving (cuDNN plans)",
            f"{r['split_warm_up']['shapes']} shapes in {r['split_warm_up']['seconds']:.1f} s",
            "",
        ),
        (
            f"forward at {NEW_LENGTHS} lengths, median ms (bucketed / triton): new, seen, new",
            ", ".join(
                f"{statistics.median(p['new_lengths_first_call_ms']['bucketed'][k]):.1f} / "
                f"{statistics.median(p['new_lengths_first_call_ms']['triton'][k]):.1f}"
                for k in ("new", "seen", "new_again")
            ),
            "",
        ),
        (
            "cached-prefix attention 512 after 7.5K",
            f"split {a['split_tflops']:.0f} TFLOP/s ({a['split_ms'] * 1e3:.0f} us, "
            f"err {a['split_rel_err_vs_reference']:.1e}); paged Triton "
            f"{a['paged_triton_tflops']:.0f}; cuDNN over the pages "
            f"{a.get('cudnn_pages_tflops', float('nan')):.0f} "
            f"(err {a.get('cudnn_pages_rel_err_vs_reference', float('nan')):.1e})",
            ">= 450 TFLOP/s",
        ),
        *(
            (
                f"the same in the hit's forward ({r['block_size']}-token blocks {where},"
                f" {af['page_tokens']}-token pages; kernel time)",
                f"{af['tflops']:.0f} TFLOP/s ({af['per_layer_us']:.0f} us a layer;"
                f" forward {af['forward_ms']:.1f} ms)",
                ">= 450 TFLOP/s",
            )
            for where, af in (
                ("in a run", r["attention_in_forward"]),
                ("scattered", r["attention_in_forward_scattered"]),
            )
        ),
        (
            "prefill 7.5K/8K cached (gather+flash)",
            f"{p['cached_ms']['gather+flash']:.1f} ms: {p['ttft_ratio_gather_flash']:.1f}x",
            "",
        ),
        (
            "decode b32 @2K (triton + CUDA graphs)",
            f"{d['triton+graphs']['step_ms']:.2f} ms/step = "
            f"{d['triton+graphs']['tokens_per_s']:.0f} tok/s "
            f"({d['triton+graphs']['tokens_per_s'] / hf_dec['tokens_per_s']:.1f}x HF; "
            f"same tokens as eager: {d['graphs_same_tokens_as_eager']})",
            ">= 3,500 tok/s, >= 6x HF",
        ),
        (
            "decode b32 @2K (graphs, next step queued before the host reads the tokens)",
            f"{d['triton+graphs, fed on the device']['step_ms']:.2f} ms/step = "
            f"{d['triton+graphs, fed on the device']['tokens_per_s']:.0f} tok/s "
            f"({d['triton+graphs, fed on the device']['tokens_per_s'] / hf_dec['tokens_per_s']:.1f}"
            f"x HF; same tokens: {d['fed_same_tokens_as_host_loop']})",
            ">= 3,500 tok/s, >= 6x HF",
        ),
        (
            "decode b32 @2K (graphs, K/V written apart from RoPE)",
            f"{d['triton+graphs, K/V written apart']['step_ms']:.2f} ms/step "
            f"(same tokens: {d['kv_write_same_tokens_as_apart']})",
            "",
        ),
        (
            "decode b32 @2K (graphs, torch elementwise ops, cuBLAS projections)",
            f"{d['triton+graphs, torch elementwise']['step_ms']:.2f} ms/step = "
            f"{d['triton+graphs, torch elementwise']['tokens_per_s']:.0f} tok/s "
            f"(same tokens as fused: {d['fused_same_tokens_as_torch']})",
            "",
        ),
        (
            "decode b32 @2K (triton, eager launches)",
            f"{d['triton']['step_ms']:.2f} ms/step = "
            f"{d['triton']['tokens_per_s']:.0f} tok/s "
            f"({d['triton']['tokens_per_s'] / hf_dec['tokens_per_s']:.1f}x HF)",
            "",
        ),
        ("decode b32 @2K (gather+sdpa)", f"{d['gather+sdpa']['step_ms']:.2f} ms/step", ""),
        (
            "decode b32 @2K, HF eager generate",
            f"{hf_dec['step_ms']:.2f} ms/step = {hf_dec['tokens_per_s']:.0f} tok/s",
            "",
        ),
        (
            "paged decode kernel b32 @2K",
            f"{k['gbps']:.0f} GB/s ({k['us']:.0f} us, "
            f"{k['splits']} splits; best variant {kb['gbps']:.0f})",
            ">= 1500 GB/s",
        ),
    ]
    return rows


def print_table(r: dict[str, Any]) -> None:
    rows = table_rows(r)
    width = max(len(a) for a, _, _ in rows)
    print(f"\n{r['device']}\n{'benchmark':<{width}}  {'measured':<58}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:<58}  {goal}")


if __name__ == "__main__":
    main()
