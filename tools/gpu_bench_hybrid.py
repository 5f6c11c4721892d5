"""Issue 7's benchmark: the CUDA hybrid runner on Qwen3.6-27B- and 35B-A3B-shaped models, random bf16
weights made on the GPU, side by side with transformers on the same shapes in the same run.

    python tools/gpu_bench_hybrid.py --model 27b|a3b [--json OUT.json] [--steps 16] [--prefill 8192]
                                     [--batches 1,4,8] [--context 512] [--prefill-rows 512]
                                     [--prefill-rows-ablation ROWS[,ROWS...]] [--prefill-graph-ablation]
                                     [--moe-prefill-ablation 'GATE_UP,DOWN,PAIRS;...']
                                     [--peer transformers|none]
                                     [--overlap-ablation] [--fold-route-ablation] [--fold-combine-ablation]
                                     [--fused-step-ablation] [--merged-attention-ablation] [--conv-in-gemv-ablation]
                                     [--rule-norm-ablation] [--roped-attention-ablation]
                                     [--attention-split-ablation KEYS[,KEYS...]] [--attention-blocks-ablation N[,N...]]
                                     [--route-experts-ablation] [--down-prefetch-ablation SHARE[,SHARE...]]
                                     [--gemm-prefetch-ablation]
                                     [--rule-splits-ablation N[,N...]] [--early-router-ablation]
                                     [--moe-gemms-ablation 'GATE_UP,DOWN;...'] [--chunked-rule-ablation]
                                     [--next-prefetch-ablation MIB[,MIB...]] [--router-prefetch-ablation MIB[,MIB...]]
                                     [--moe-builds-ablation 'OPTION=NAME|off[+...];...'] [--profile]

Prints, all measured in this one run on this one card: device-to-device copy bandwidth (the
roofline's denominator); decode tok/s at each batch (one step at a time; pipelined, the next step
launched before this one's tokens are read, as the Engine drives the runner; and device time alone:
the CUDA Graph replayed back to back), with achieved GB/s and % of roofline, where a step reads every weight matrix (for MoE layers
the router, the shared expert and the distinct experts the batch routes to, expected count under
uniform routing), each lane's StateImage once and writes it once, and its KV; prefill tok/s of one
``--prefill``-token prompt; TTFT of a 64-token turn after a 4k-token conversation, cold (the whole
conversation prefilled) and reused (the checkpointed StateImage copied back, the KV pages kept). Each
``--*-ablation`` decodes again with one option changed, and after them the defaults once more (the
run's drift: a 35B-A3B batch-1 step's tok/s moves about 2% from run to run, its GPU time less); then
transformers (``qwen3_5`` / ``qwen3_5_moe`` text models, random init, bf16, eager, its own DeltaNet
fallback when flash-linear-attention is absent) on the same measurements. ``--profile`` adds, at
batch 1, the step's GPU time with each kernel family left out of its graph (``HYBRID_ABLATIONS``)
and each kernel's device time in one eager step (events around every launch, so gaps included).
torch makes the random weights on the GPU and runs the peer; NInfer itself runs through cuda.bindings
and our PTX, over the same primary context. Our weights are freed before the peer is built.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_bench import ablate, copy_bandwidth, profile_decode  # noqa: E402  (this folder is on sys.path)
from bench_prefill import every_row_out  # noqa: E402

from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.cuda.hybrid_forward import SPLIT_RULE_ROWS  # noqa: E402
from ninfer.backends.cuda.hybrid_weights import device_layout  # noqa: E402
from ninfer.backends.cuda.moe import EARLY_ROUTER_GEMM, GEMV_GEMMS, ROUTE_EXPERTS, combine_gemm  # noqa: E402
from ninfer.backends.runner import PrefillChunk, SamplingRow  # noqa: E402
from ninfer.commands import runner_timing  # noqa: E402
from ninfer.models.hybrid import DENSE, FULL, LINEAR, MOE, HybridConfig  # noqa: E402

PAGE = 16
CONVERSATION, TURN = 4096, 64  # TTFT: a new turn of TURN tokens after CONVERSATION tokens
# --profile's kernel families (name prefixes), each left out of a decode graph in turn
HYBRID_ABLATIONS = {"deltanet": ("deltanet_",), "gated attention": ("gated_",), "moe experts": ("moe_",),
                    "gemms": ("gemv_", "mma_gemv"), "norms": ("rmsnorm", "add_rmsnorm"),
                    "sample+count": ("sample", "count_tokens")}


def _layer_types(layers: int) -> tuple[str, ...]:
    """Every fourth layer full attention, as the Qwen3.5 family's full_attention_interval 4."""
    return tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers))


SHARED = dict(vocab_size=248320, rms_norm_eps=1e-6, head_dim=256, rotary_dim=64, rope_theta=1e7,
              max_position_embeddings=262144, linear_num_k_heads=16, linear_k_head_dim=128,
              linear_v_head_dim=128, conv_kernel=4)
MODELS = {
    "27b": HybridConfig(architecture="Qwen3_5ForCausalLM", hidden_size=5120, num_layers=64,
                        layer_types=_layer_types(64), mlp_types=(DENSE,) * 64, num_heads=24, num_kv_heads=4,
                        linear_num_v_heads=48, intermediate_size=17408, **SHARED),
    "a3b": HybridConfig(architecture="Qwen3_5MoeForCausalLM", hidden_size=2048, num_layers=40,
                        layer_types=_layer_types(40), mlp_types=(MOE,) * 40, num_heads=16, num_kv_heads=2,
                        linear_num_v_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, norm_topk_prob=True, **SHARED),
}


# -- weights and the bytes a step reads -----------------------------------------------------------

def random_weights(config: HybridConfig, torch) -> dict:
    """Every tensor of ``hybrid_weights.device_layout``: bf16 matrices ~N(0, 1/fan_in), fp32 norms
    (stored as ``1 + w``) ~1, ``A_log`` and ``dt_bias`` small, the depthwise conv ~N(0, 1/4)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, (shape, kind) in device_layout(config).items():
        role = name.rsplit(".", 1)[-1]
        if kind == "bf16":
            scale = 1.0 if role == "embed" else shape[-1] ** -0.5
            t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * scale
        elif role.endswith("norm"):
            t = 1 + 0.1 * torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
        else:
            t = shape[-1] ** -0.5 * torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
        tensors[name] = t.contiguous()
    torch.cuda.synchronize()
    return tensors


def expected_experts(config: HybridConfig, batch: int) -> float:
    """Distinct experts ``batch`` rows route to in one layer if each row picks k of E uniformly."""
    e, k = config.num_experts, config.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch) if e else 0.0


def step_bytes(config: HybridConfig, batch: int, context: int) -> float:
    """Bytes one decode step must move: weights (not the embedding table), states, KV."""
    total = 0.0
    for name, (shape, kind) in device_layout(config).items():
        size = int(np.prod(shape)) * (2 if kind == "bf16" else 4)
        if name == "embed" and not config.tie_word_embeddings:
            continue
        if name.endswith(("experts.gate_up", "experts.down")):
            size *= expected_experts(config, batch) / config.num_experts
        total += size
    states = 2 * batch * config.state_floats * 4  # read and written once
    return total + states + batch * context * config.kv_bytes_per_token


# -- our side ---------------------------------------------------------------------------------

def _tables(runner, lanes) -> np.ndarray:
    pages = runner.buffers.max_pages
    return np.stack([np.arange(pages) + lane * pages for lane in lanes]).astype(np.int32)


def _forget_states(runner) -> None:
    """Trust whatever the lanes hold (benchmark inputs, not a conversation): any position may follow."""
    runner.states.length[:] = -1


def bench_decode(runner, config, batch: int, context: int, steps: int, copy_bw: float) -> dict:
    """runner_timing's decode figures (one step at a time, pipelined where the runner pipelines decode,
    the graph alone) with this model's step bytes; each pass over the positions trusts the lanes' states."""
    return runner_timing.bench_decode(runner, config, batch, context, steps, copy_bw,
                                      step_bytes=lambda rows, kv_tokens: step_bytes(config, rows, kv_tokens),
                                      rewind=lambda: _forget_states(runner))


def _prompt(n: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(n) * 7919 + salt) % 151936).astype(np.int32)


def _prefill(runner, lane: int, tokens: np.ndarray, start: int) -> float:
    t0 = time.perf_counter()
    runner.prefill(PrefillChunk(lane=lane, tokens=tokens, start=start, page_table=_tables(runner, [lane])[0],
                                sample=SamplingRow()))
    return time.perf_counter() - t0


def bench_prefill(runner, tokens: int) -> dict:
    _forget_states(runner)
    for _ in range(2):  # warm-up: module loads and a sub-chunk's plans, then the prefill graph's capture
        _prefill(runner, 0, _prompt(min(tokens, runner.buffers.rows)), 0)
    seconds = _prefill(runner, 0, _prompt(tokens), 0)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def bench_ttft(runner, conversation_tokens: int = CONVERSATION) -> dict:
    """A 64-token turn after a conversation: cold (all prefilled) vs reused (state checkpoint + KV)."""
    _forget_states(runner)
    conversation, turn = _prompt(conversation_tokens, 1), _prompt(TURN, 2)
    checkpoint = runner.info.max_batch  # the first extra StateImage slot
    _prefill(runner, 0, conversation, 0)
    runner.copy_state(0, checkpoint)  # what the Engine keeps at the end of a turn
    cold = _prefill(runner, 1, np.concatenate([conversation, turn]), 0)
    t0 = time.perf_counter()
    runner.copy_state(checkpoint, 0)
    _prefill(runner, 0, turn, conversation_tokens)
    reused = time.perf_counter() - t0
    return {"conversation": conversation_tokens, "turn": TURN, "cold_ms": cold * 1e3, "reused_ms": reused * 1e3,
            "speedup": cold / reused}


def run_ours(args, config: HybridConfig, torch, copy_bw: float) -> dict:
    from ninfer.backends.cuda.hybrid_forward import HybridForward
    from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner

    device = rt.Device(0)
    t0 = time.perf_counter()
    tensors = random_weights(config, torch)
    ptrs = {n: rt.DevicePtr(t.data_ptr(), t.numel() * t.element_size(), n) for n, t in tensors.items()}
    made_s = time.perf_counter() - t0
    batches = [int(b) for b in args.batches.split(",")]
    max_context = max(args.context + args.steps + 8, args.prefill, CONVERSATION + TURN)
    pages = -(-max_context // PAGE)
    chunked_default = HybridForward.chunked_rule
    HybridForward.chunked_rule = chunked_default or args.chunked_rule_ablation  # the buffers carve its scratch
    runner = CudaHybridRunner.from_device_weights(
        config, ptrs, device=device, page_size=PAGE, num_pages=max(max(batches), 2) * pages,
        max_batch=max(max(batches), 2), max_context=max_context, max_prefill_rows=args.prefill_rows, prefill_gemm="cublaslt",
        state_slots=1)
    HybridForward.chunked_rule = runner.forward.chunked_rule = chunked_default
    report = {"weights_gb": sum(p.nbytes for p in ptrs.values()) / 1e9, "weights_made_s": made_s,
              "startup": runner.startup, "decode": []}
    print(f"ours: {report['weights_gb']:.1f} GB of weights made in {made_s:.1f} s; startup",
          json.dumps(runner.startup), flush=True)
    for batch in batches:
        r = bench_decode(runner, config, batch, args.context, args.steps, copy_bw)
        report["decode"].append(r)
        print("ours decode b={batch} ctx={context}: {tok_s:.1f} tok/s, step {step_ms:.2f} ms (gpu {gpu_step_ms:.2f}),"
              " {achieved_gb_s:.0f} GB/s, {pct_roofline:.1f}% of roofline ({roofline_tok_s:.0f} tok/s); ".format(**r)
              + pipelined_text(r), flush=True)
    variants = ablations(args, runner.forward)
    if variants:  # and the defaults once more at the end: the drift over the run, against which to read them
        variants.append(("decode_defaults_again", "defaults again", []))
    for key, label, settings in variants:  # the same steps again
        was = [(target, option, getattr(target, option)) for target, option, _ in settings]
        for target, option, value in settings:
            setattr(target, option, value)
        recapture(runner)
        report[key] = []
        for batch in batches:
            r = bench_decode(runner, config, batch, args.context, args.steps, copy_bw)
            report[key].append(r)
            print(f"ours decode, {label}, " + "b={batch}: {tok_s:.1f} tok/s (gpu {gpu_step_ms:.2f} ms), "
                  "{pct_roofline:.1f}% of roofline; ".format(**r) + pipelined_text(r), flush=True)
        for target, option, value in was:
            setattr(target, option, value)
        recapture(runner)
    if args.profile:
        profile(runner, args.context, report)
    if args.prefill:
        report["prefill"] = r = bench_prefill(runner, args.prefill)
        print(f"ours prefill {r['tokens']} tokens: {r['seconds']:.2f} s = {r['tok_s']:.0f} tok/s", flush=True)
        if args.prefill_outputs_ablation:  # every sub-chunk's pass to its hidden states, then as the runner runs it
            for key, full in (("prefill_full_passes", True), ("prefill_again", False)):
                every_row_out(runner, full)
                report[key] = r = bench_prefill(runner, args.prefill)
                print(f"ours prefill, {'every' if full else 'the last'} sub-chunk to its hidden states: "
                      f"{r['seconds'] * 1e3:.1f} ms = {r['tok_s']:.0f} tok/s", flush=True)
        if args.prefill_graph_ablation:  # every sub-chunk launched kernel by kernel, then the graph again
            for key, rows in (("prefill_launched", None), ("prefill_graph_again", runner.graph_prefill_rows)):
                runner.graph_prefill_rows = rows
                report[key] = r = bench_prefill(runner, args.prefill)
                print(f"ours prefill, {'graph' if rows else 'launched'}: {r['seconds'] * 1e3:.1f} ms = "
                      f"{r['tok_s']:.0f} tok/s", flush=True)
    bench_ttft(runner, 512)  # warm-up: every prefill shape once
    report["ttft"] = r = bench_ttft(runner)
    print(f"ours TTFT of a {TURN}-token turn after {CONVERSATION} tokens: cold {r['cold_ms']:.0f} ms, "
          f"reused {r['reused_ms']:.1f} ms ({r['speedup']:.0f}x)", flush=True)
    if args.chunked_rule_ablation:  # prefill again with the delta rule's other form
        runner.forward.chunked_rule = not chunked_default
        runner.forget_prefill_graph()  # captured with the other form
        label = f"chunked_rule {runner.forward.chunked_rule}"
        if args.prefill:
            report["prefill_chunked_rule"] = r = bench_prefill(runner, args.prefill)
            print(f"ours prefill, {label}, {r['tokens']} tokens: {r['seconds']:.2f} s = {r['tok_s']:.0f} tok/s",
                  flush=True)
        report["ttft_chunked_rule"] = r = bench_ttft(runner)
        print(f"ours TTFT, {label}: cold {r['cold_ms']:.0f} ms, reused {r['reused_ms']:.1f} ms", flush=True)
        runner.forward.chunked_rule = chunked_default
        runner.forget_prefill_graph()
    built_rows, graph_rows = runner.buffers.rows, runner.graph_prefill_rows
    for rows in (int(v) for v in filter(None, args.prefill_rows_ablation.split(","))):  # smaller sub-chunks
        if args.prefill:  # the prefill loop's step (below built_rows: main checks); the buffers stay as built
            runner.buffers.rows = rows
            runner.graph_prefill_rows = rows if graph_rows else None  # as ninfer serve's chunks of that size
            report[f"prefill_rows_{rows}"] = r = bench_prefill(runner, args.prefill)
            print(f"ours prefill, sub-chunks of {rows} rows, {r['tokens']} tokens: {r['seconds']:.2f} s = "
                  f"{r['tok_s']:.0f} tok/s", flush=True)
    runner.buffers.rows, runner.graph_prefill_rows = built_rows, graph_rows
    moe = runner.forward.moe
    for spec in filter(None, args.moe_prefill_ablation.split(";")):  # other grouped prefill GEMMs, full sub-chunks
        if args.prefill and moe is not None:
            gate_up, down, pairs = spec.split(",")
            was, moe.prefill_gemms = moe.prefill_gemms, (gate_up, down, int(pairs))
            runner.forget_prefill_graph()  # captured with the other GEMMs
            report[f"prefill_moe_{gate_up}_{down}_{pairs}"] = r = bench_prefill(runner, args.prefill)
            print(f"ours prefill, MoE GEMMs {gate_up} {down} ({pairs} pairs a chunk), {r['tokens']} tokens: "
                  f"{r['seconds']:.2f} s = {r['tok_s']:.0f} tok/s", flush=True)
            moe.prefill_gemms = was
            runner.forget_prefill_graph()
    runner.close()
    del tensors, ptrs
    torch.cuda.empty_cache()
    return report


def profile(runner, context: int, report: dict) -> None:
    """``--profile``: where a batch-1 decode step's GPU time goes, by kernel family and by kernel."""
    _forget_states(runner)
    report["ablation_b1"] = r = ablate(runner, 1, context, families=HYBRID_ABLATIONS)
    print(f"ours ablation b=1 GPU ms: full {r['full']:.3f}; without: "
          + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "full"), flush=True)
    report["profile_b1"] = r = profile_decode(runner, 1)
    print("ours profile b=1, us a step (eager):", ", ".join(f"{k} {v:.0f}" for k, v in r.items()), flush=True)


def pipelined_text(r: dict) -> str:
    if r["pipelined_tok_s"] is None:
        return "no pipelined decode (CudaHybridRunner launches one step at a time)"
    return "pipelined {pipelined_tok_s:.1f} tok/s, {pipelined_pct_roofline:.1f}% of roofline".format(**r)


def ablations(args, forward) -> list[tuple]:
    """The variants of the step asked for: (report key, label, [(object, attribute, value to set), ...])."""
    moe = forward.moe
    chosen = []
    if args.overlap_ablation:  # launches that do not overlap (Forward.overlap off)
        chosen.append(("decode_not_overlapped", "launches not overlapped", [(forward, "overlap", False)]))
    if args.fused_step_ablation:  # HybridForward.fused_step flipped: the decode conv and delta rule in one launch
        value = not forward.fused_step
        forward.k[forward.step_name]  # loaded now: not during capture
        chosen.append((f"decode_fused_step_{value}", f"fused_step {value}", [(forward, "fused_step", value)]))
    if args.conv_in_gemv_ablation:  # HybridForward.conv_in_gemv flipped: the conv in its own launch, or not
        value = not forward.conv_in_gemv
        chosen.append((f"decode_conv_in_gemv_{value}", f"conv_in_gemv {value}", [(forward, "conv_in_gemv", value)]))
    if args.roped_attention_ablation:  # HybridForward.roped_attention flipped: the q/k kernel in its own launch, or not
        value = not forward.roped_attention
        chosen.append((f"decode_roped_attention_{value}", f"roped_attention {value}",
                       [(forward, "roped_attention", value)]))
    for keys in filter(None, args.attention_split_ablation.split(",")):  # longer decode attention splits
        chosen.append((f"decode_attention_split_{keys}", f"attention splits of {keys}+ keys",
                       [(forward, "min_decode_split", int(keys))]))
    for blocks in filter(None, args.attention_blocks_ablation.split(",")):  # a cap on the attention's blocks
        chosen.append((f"decode_attention_blocks_{blocks}", f"attention of at most {blocks} blocks",
                       [(forward, "decode_blocks", int(blocks))]))
    if args.rule_norm_ablation:  # HybridForward.rule_norm_in_gemv flipped: the split rule's ticket scales, or the out GEMV
        value = not forward.rule_norm_in_gemv
        chosen.append((f"decode_rule_norm_in_gemv_{value}", f"rule_norm_in_gemv {value}",
                       [(forward, "rule_norm_in_gemv", value)]))
    if args.merged_attention_ablation:  # HybridForward.merged_attention flipped: no gated_combine launch
        value = not forward.merged_attention
        forward.k[forward.merged_attention_name]  # loaded now: not during capture
        chosen.append((f"decode_merged_attention_{value}", f"merged_attention {value}",
                       [(forward, "merged_attention", value)]))
    for splits in filter(None, args.rule_splits_ablation.split(",")):  # the delta rule's columns over N blocks
        if int(splits):
            forward.k[forward.split_rule_names[int(splits)]]  # loaded now: not during capture
        chosen.append((f"decode_rule_splits_{splits}", f"rule_splits {splits} (at most {SPLIT_RULE_ROWS} rows)",
                       [(forward, "rule_splits", int(splits))]))
    for fold in ("route", "combine"):  # CudaMoe.fold_route / fold_combine flipped
        option = f"fold_{fold}"
        if getattr(args, f"{option}_ablation") and moe is not None:
            value = not getattr(moe, option)
            chosen.append((f"decode_{option}_{value}", f"MoE {option} {value}", [(moe, option, value)]))
    if args.preload_o_ablation:  # Forward.preload_o flipped: the one-row o GEMV holds 4 steps before its wait
        chosen.append((f"decode_preload_o_{not forward.preload_o}", f"preload_o {not forward.preload_o}",
                       [(forward, "preload_o", not forward.preload_o)]))
    for share in filter(None, args.down_prefetch_ablation.split(",")):  # CudaMoe.down_prefetch set to SHARE
        if moe is not None:
            chosen.append((f"decode_down_prefetch_{share}", f"down prefetch {share}",
                           [(moe, "down_prefetch", float(share))]))
    if args.gemm_prefetch_ablation:  # Forward.gemm_prefetch emptied: no batched GEMM asks L2 for the next one's
        chosen.append(("decode_no_gemm_prefetch", "no GEMM prefetch", [(forward, "gemm_prefetch", {})]))
    if args.early_router_ablation and moe is not None:  # the router GEMM streams its weights before the wait
        forward.k[EARLY_ROUTER_GEMM]  # loaded now: not during capture
        chosen.append(("decode_early_router", "MoE early router", [(moe, "early_router", not moe.early_router)]))
    if args.route_experts_ablation and moe is not None:  # the routing's build for the most experts
        most = ROUTE_EXPERTS[-1]
        for kind in ("moe_route", "moe_router_route"):
            forward.k[f"{kind}_e{most}"]  # loaded now: not during capture
        chosen.append((f"decode_route_experts_{most}", f"MoE routing built for {most} experts",
                       [(moe, "route_experts", most)]))
    for pair in filter(None, args.moe_gemms_ablation.split(";")):  # other grouped decode GEMMs: gate_up,down
        if moe is None:
            break
        gate_up, down = pair.split(",")
        for name in (gate_up, down) + ((combine_gemm(down),) if moe.fold_combine else ()):
            forward.k[name]  # loaded now: not during capture
        chosen.append((f"decode_moe_gemms_{gate_up}_{down}", f"MoE GEMMs {gate_up} {down}",
                       [(moe, "decode_gemms", (gate_up, down, moe.decode_gemms[2]))]))
    for pairs in filter(None, args.moe_gemv_ablation.split(";")):  # the expert GEMMs of 1-2 rows as fp32 GEMVs
        if moe is None:
            break
        if pairs == "off":  # the tensor-core grouped GEMMs at every row count
            chosen.append(("decode_moe_gemv_off", "MoE GEMVs off", [(moe, "gemv_rows", 0)]))
            continue
        gemms = dict(GEMV_GEMMS)
        if pairs != "default":  # the batch-1 pair named
            gemms[1] = tuple(pairs.split(","))
        for name in (n for pair in gemms.values() for n in pair):
            forward.k[name]  # loaded now: not during capture
        chosen.append((f"decode_moe_gemv_{'_'.join(gemms[1])}", f"MoE GEMVs {' '.join(gemms[1])} (1-2 rows)",
                       [(moe, "gemv_rows", 2), (moe, "gemv_gemms", gemms)]))
    for mib in filter(None, args.next_prefetch_ablation.split(",")):  # CudaMoe.next_prefetch set to MIB MiB
        if moe is None:
            break
        chosen.append((f"decode_next_prefetch_{mib}", f"MoE router asks L2 for {float(mib):g} MiB of the next layer",
                       [(moe, "next_prefetch", int(float(mib) * (1 << 20)))]))
    for mib in filter(None, args.router_prefetch_ablation.split(",")):  # HybridForward.router_prefetch: MIB MiB
        if moe is None:
            break
        chosen.append((f"decode_router_prefetch_{mib}", f"o / out GEMV asks L2 for {float(mib):g} MiB of the router",
                       [(forward, "router_prefetch", int(float(mib) * (1 << 20)))]))
    for spec in filter(None, args.moe_builds_ablation.split(";")):  # CudaMoe's optional one-row builds
        if moe is None:
            break
        settings = []
        for part in spec.split("+"):
            option, _, name = part.partition("=")
            if option == "router_prefetch":  # HybridForward's, in MiB: to time it with a build
                settings.append((forward, option, int(float(name) * (1 << 20))))
                continue
            if option not in ("routed_gate_up", "combined_down", "router_gemv"):
                raise SystemExit(f"--moe-builds-ablation: {option} is not routed_gate_up, combined_down, router_gemv "
                                 "or router_prefetch")
            value = None if name == "off" else name
            if value:
                forward.k[value]  # loaded now: not during capture
            settings.append((moe, option, value))
        chosen.append((f"decode_moe_builds_{spec}", f"MoE {spec}", settings))
    return chosen


def recapture(runner) -> None:
    """Capture the runner's decode graphs again (after a change to its forward's options); the prefill
    graph is captured again at the second whole sub-chunk after."""
    runner.forget_prefill_graph()
    for rows, by_depth in runner.graphs.items():
        for graph in (g for pair in by_depth.values() for g in pair):
            graph.destroy()
        runner.graphs[rows] = runner._capture_decode(rows)


# -- transformers -----------------------------------------------------------------------------

def hf_model(config: HybridConfig, torch):
    import transformers

    fields = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                  num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
                  linear_num_key_heads=config.linear_num_k_heads, linear_num_value_heads=config.linear_num_v_heads,
                  linear_key_head_dim=config.linear_k_head_dim, linear_value_head_dim=config.linear_v_head_dim,
                  linear_conv_kernel_dim=config.conv_kernel, rms_norm_eps=config.rms_norm_eps,
                  max_position_embeddings=config.max_position_embeddings, layer_types=list(config.layer_types),
                  tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="default", rope_theta=config.rope_theta,
                                       partial_rotary_factor=config.rotary_dim / config.head_dim))
    if MOE in config.mlp_types:
        fields.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                      moe_intermediate_size=config.moe_intermediate_size,
                      shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                      norm_topk_prob=config.norm_topk_prob)
        hf_config, cls = transformers.Qwen3_5MoeTextConfig(**fields), transformers.Qwen3_5MoeForCausalLM
    else:
        hf_config = transformers.Qwen3_5TextConfig(intermediate_size=config.intermediate_size, **fields)
        cls = transformers.Qwen3_5ForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(hf_config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model


def _timed(torch, fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def peer_ttft(model, torch, vocab: int, conversation: int) -> dict:
    """transformers' TTFT of a turn: the whole conversation again, or the turn on its kept cache."""
    ids = torch.randint(0, vocab, (1, conversation + TURN), device="cuda")
    cold, _ = _timed(torch, lambda: model(ids, logits_to_keep=1))
    out = model(ids[:, :conversation], use_cache=True, logits_to_keep=1)
    reused, _ = _timed(torch, lambda: model(ids[:, conversation:], past_key_values=out.past_key_values,
                                            use_cache=True, logits_to_keep=1))
    return {"conversation": conversation, "turn": TURN, "cold_ms": cold * 1e3, "reused_ms": reused * 1e3}


def run_peer(args, config: HybridConfig, torch) -> dict:
    import transformers

    t0 = time.perf_counter()
    model = hf_model(config, torch)
    report = {"peer": f"transformers {transformers.__version__} eager",
              "build_s": time.perf_counter() - t0, "decode": []}
    print(f"peer: {report['peer']}, built in {report['build_s']:.1f} s", flush=True)
    vocab = config.vocab_size
    with torch.no_grad():
        for batch in [int(b) for b in args.batches.split(",")]:
            ids = torch.randint(0, vocab, (batch, args.context), device="cuda")
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
            first, _ = _timed(torch, lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False))
            n = args.peer_tokens
            total, _ = _timed(torch, lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False))
            tok_s = batch * (n - 1) / (total - first)
            report["decode"].append({"batch": batch, "context": args.context, "tok_s": tok_s})
            print(f"peer decode b={batch} ctx={args.context}: {tok_s:.1f} tok/s", flush=True)
        if args.prefill:
            ids = torch.randint(0, vocab, (1, args.prefill), device="cuda")
            seconds, _ = _timed(torch, lambda: model(ids, logits_to_keep=1))
            report["prefill"] = {"tokens": args.prefill, "seconds": seconds, "tok_s": args.prefill / seconds}
            print(f"peer prefill {args.prefill} tokens: {seconds:.2f} s = {args.prefill / seconds:.0f} tok/s", flush=True)
        peer_ttft(model, torch, vocab, 512)  # warm-up
        report["ttft"] = r = peer_ttft(model, torch, vocab, CONVERSATION)
        print(f"peer TTFT of a {TURN}-token turn after {CONVERSATION} tokens: cold {r['cold_ms']:.0f} ms, "
              f"reused (its cache object) {r['reused_ms']:.1f} ms", flush=True)
    del model
    torch.cuda.empty_cache()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-rows", type=int, default=512,
                        help="the runner's prefill sub-chunk (max_prefill_rows): a larger one gives each MoE "
                             "expert more rows per read of its weights")
    parser.add_argument("--prefill-rows-ablation", default="", metavar="ROWS[,ROWS...]",
                        help="prefill again in sub-chunks of ROWS rows (each below --prefill-rows, whose buffers "
                             "serve them)")
    parser.add_argument("--prefill-outputs-ablation", action="store_true",
                        help="prefill again with every sub-chunk computing its hidden states, then as the runner "
                             "does (only the sub-chunk that samples)")
    parser.add_argument("--prefill-graph-ablation", action="store_true",
                        help="prefill again with every sub-chunk launched kernel by kernel, then with the graph")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--peer", choices=("transformers", "none"), default="transformers")
    parser.add_argument("--peer-tokens", type=int, default=8, help="tokens each peer decode generates")
    parser.add_argument("--ours", choices=("yes", "no"), default="yes", help="no: the peer alone")
    parser.add_argument("--overlap-ablation", action="store_true",
                        help="decode again with launches that do not overlap their predecessor")
    parser.add_argument("--fold-route-ablation", action="store_true",
                        help="decode again with the MoE's routing folded into its router GEMM (or not, if it is)")
    parser.add_argument("--fold-combine-ablation", action="store_true",
                        help="decode again with the MoE's combine folded into its down GEMM (or not, if it is)")
    parser.add_argument("--fused-step-ablation", action="store_true",
                        help="decode again with the DeltaNet conv and delta rule in one launch (or two, if one)")
    parser.add_argument("--merged-attention-ablation", action="store_true",
                        help="decode again with the gated attention merging its own splits (or not, if it does)")
    parser.add_argument("--rule-splits-ablation", default="", metavar="N[,N...]",
                        help="decode again with each head's delta-rule state columns over N blocks, 0: one "
                             "(HybridForward.rule_splits, steps of at most SPLIT_RULE_ROWS rows)")
    parser.add_argument("--early-router-ablation", action="store_true",
                        help="decode again with the MoE router GEMM loading its weights before the wait (or not, "
                             "if it does)")
    parser.add_argument("--route-experts-ablation", action="store_true",
                        help="decode again with the MoE routing's build for the most experts (more slots a lane)")
    parser.add_argument("--moe-gemms-ablation", default="", metavar="GATE_UP,DOWN[;...]",
                        help="decode again with each pair of grouped MoE decode GEMMs (e.g. the 'h' builds)")
    parser.add_argument("--moe-gemv-ablation", default="", metavar="off|default|GATE_UP,DOWN[;...]",
                        help="decode again with the expert GEMMs of 1-2 rows as fp32 GEMVs (CudaMoe.gemv_rows 2): "
                             "'default' for moe.GEMV_GEMMS, or the batch-1 pair named; 'off': none (gemv_rows 0)")
    parser.add_argument("--down-prefetch-ablation", default="", help="comma-separated CudaMoe.down_prefetch "
                        "shares to time (the routed gate/up asks L2 for each chunk's down weights at its tail)")
    parser.add_argument("--gemm-prefetch-ablation", action="store_true",
                        help="decode again with Forward.gemm_prefetch empty (batched steps' GEMMs asking L2 for "
                             "nothing of the next GEMM's weights)")
    parser.add_argument("--preload-o-ablation", action="store_true",
                        help="decode again with Forward.preload_o flipped (a one-row step's o GEMV holding its "
                             "first four steps of weights before its wait)")
    parser.add_argument("--moe-builds-ablation", default="", metavar="OPTION=NAME|off[+...][;...]",
                        help="decode again with CudaMoe's one-row builds set: routed_gate_up (a gate/up GEMV "
                             "routing the row itself, no moe_route launch), combined_down (the down GEMV adding "
                             "into the residual stream, no combine launch), router_gemv (the router as an fp32 "
                             "GEMV); 'off' for None; and router_prefetch=MIB (HybridForward's)")
    parser.add_argument("--next-prefetch-ablation", default="", metavar="MIB[,MIB...]",
                        help="decode again with a one-row step's MoE router asking L2 for the first MIB MiB of the "
                             "next layer's first GEMM (CudaMoe.next_prefetch; 0: nothing)")
    parser.add_argument("--router-prefetch-ablation", default="", metavar="MIB[,MIB...]",
                        help="decode again with a one-row step's o / out GEMV asking L2 for the first MIB MiB of the "
                             "layer's MoE router (HybridForward.router_prefetch; 0: nothing)")
    parser.add_argument("--moe-prefill-ablation", default="", metavar="GATE_UP,DOWN,PAIRS[;...]",
                        help="prefill again (sub-chunks of --prefill-rows) with other grouped MoE prefill GEMMs "
                             "and PAIRS pairs a chunk (CudaMoe.prefill_gemms; their builds' 8 x P pairs)")
    parser.add_argument("--conv-in-gemv-ablation", action="store_true",
                        help="decode again with HybridForward.conv_in_gemv flipped (the one- and two-row in_proj "
                             "GEMV runs the DeltaNet conv)")
    parser.add_argument("--roped-attention-ablation", action="store_true",
                        help="decode again with HybridForward.roped_attention flipped (the decode attention's q/k "
                             "norms, RoPE and KV append inside its split attention)")
    parser.add_argument("--attention-split-ablation", default="", metavar="KEYS[,KEYS...]",
                        help="decode again with the gated attention's splits at least KEYS keys long "
                             "(HybridForward.min_decode_split, a multiple of 32)")
    parser.add_argument("--attention-blocks-ablation", default="", metavar="BLOCKS[,BLOCKS...]",
                        help="decode again with the gated attention's splits capped at BLOCKS blocks a step "
                             "(HybridForward.decode_blocks)")
    parser.add_argument("--rule-norm-ablation", action="store_true",
                        help="decode again with HybridForward.rule_norm_in_gemv flipped (the one-row out GEMV "
                             "applies the split delta rule's gated RMSNorm)")
    parser.add_argument("--profile", action="store_true",
                        help="batch-1 decode's GPU time by kernel family (leave-one-out) and by kernel")
    parser.add_argument("--chunked-rule-ablation", action="store_true",
                        help="prefill (and TTFT) again with the chunked delta rule (HybridForward.chunked_rule "
                             "flipped)")
    args = parser.parse_args(argv)
    if any(int(rows) >= args.prefill_rows for rows in filter(None, args.prefill_rows_ablation.split(","))):
        parser.error("--prefill-rows-ablation: each sub-chunk must be smaller than --prefill-rows, whose buffers "
                     "serve it")
    import torch

    torch.zeros(1, device="cuda")  # torch and NInfer share the device's primary context
    device = rt.Device(0)
    config = MODELS[args.model]
    report: dict = {"model": args.model, "config": config.to_json(), "device": device.name}
    report["copy_gb_s"] = copy_bandwidth(device, device.stream(), nbytes=1 << 30) / 1e9
    print(f"{args.model}: device {device.name}; copy bandwidth {report['copy_gb_s']:.0f} GB/s; "
          f"batch-1 roofline {report['copy_gb_s'] * 1e9 / step_bytes(config, 1, args.context):.1f} tok/s", flush=True)
    if args.ours == "yes":
        report["ours"] = run_ours(args, config, torch, report["copy_gb_s"] * 1e9)
    if args.peer == "transformers":
        report["peer"] = run_peer(args, config, torch)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
