"""The hybrid decoder (Gated DeltaNet + gated attention) as kernel launches over static buffers.

``HybridBuffers`` is the dense ``StepBuffers`` idea for a hybrid: one workspace holding every
activation, the KV pool of the full-attention layers only (pool layout of ``rope.py`` with
``layer`` = index among the attention layers), the RoPE tables of the first ``rotary_dim``
dimensions, the sampler state, the per-step inputs (``forward.Inputs``) and every StateImage slot
(``hybrid_state.DeviceStates``). ``HybridForward`` enqueues one step; it inherits the dense
``Forward``'s GEMM dispatch (prefill GEMMs and fused decode GEMMs), LM head and sampler, and differs
in the layers:

- DeltaNet: in-projection GEMM -> ``deltanet_conv`` (conv + SiLU, conv tail updated) ->
  ``deltanet_rule_k{dk}_v{dv}`` (L2 norms, gates, delta rule, gated RMSNorm) -> ``out`` GEMM;
- attention: qkv GEMM -> ``gated_qk_rope`` (query/gate split, q/k norm, partial RoPE, KV append)
  -> ``gated_attention_d{D}`` (split-K partials) -> ``gated_combine`` (merge, sigmoid gate) -> ``o``;
- MLP: the dense SwiGLU kernels, or ``moe.CudaMoe`` (routing and grouped expert GEMMs on the device).

A prefill chunk (``layers``) normalises in ``rmsnorm`` / ``add_rmsnorm`` launches of their own and
leaves the final-normed rows in ``h``. A decode step (``decode`` -> ``decode_layers``) is the dense
decode step around the same mixer kernels: the residual stream stays in ``x``; in_proj and qkv are
"normed store" GEMMs (attn_norm in the prologue), out and o "residual" GEMMs adding into ``x``,
gate/up a normed SwiGLU GEMM into ``act`` and down a residual GEMM, the LM head a normed GEMM
(final_norm); ``forward.DECODE_GEMMS`` picks each kernel by row count (in_proj under the "qkv"
entry, out under "o"). A DeltaNet mixer is 4 launches (3 at one or two rows, whose in_proj GEMV runs
the conv: ``conv_in_gemv``), an attention mixer 5 and a dense MLP 2,
where a decode step through the prefill kernels has 5, 6 and 4. ``CudaMoe`` reads a normalised
input and overwrites its output, so an MoE MLP keeps an ``rmsnorm`` before it and an add
(``add_rmsnorm``) after it, 7 launches to 6: an MoE layer keeps its count, with its GEMMs fused.

A decode step treats each row as its own sequence, reading its state from StateImage slot
``state_in[r]`` and writing it to ``state_out[r]`` (the lane's other image: ``lane_slots.py``); a
prefill chunk is one sequence (slot ``state_in[0]``, updated in place) whose rows the DeltaNet
kernels walk in order.
"""

from __future__ import annotations

import numpy as np

from ninfer.backends.cuda import moe
from ninfer.backends.cuda import runtime as rt
from ninfer.backends.cuda.forward import (DECODE_GEMMS, GEMM_PREFETCH, KV_DTYPES, MAX_DECODE_SPLITS, MIN_SPLIT,
                                          PREFILL_ATTENTION, Forward, attention_splits, carve_workspace, check_vocab,
                                          norm_threads, prefetch_bytes, prefill_attention_grid, sampler_regions,
                                          split_length, tensor_core_regions)
from ninfer.backends.cuda.hybrid_state import DeviceStates, layer_offsets
from ninfer.backends.lane_slots import LaneSlots
from ninfer.backends.reference.rope import base_inverse_frequencies, cos_sin_tables
from ninfer.models.hybrid import DENSE, FULL, LINEAR, MOE, HybridConfig

# The variants numba_kernels/deltanet.py and gated_attention.py build (PTX in ptx/).
CONV_KERNEL = 4
DELTANET_HEAD_DIMS = (16, 32, 64, 128)
DELTANET_CHUNK = 64  # tokens per chunk of the chunked delta rule (numba_kernels/deltanet.py CHUNK)
CONV_GEMVS = {rows: f"gemv_normed_conv_m{rows}" for rows in (1, 2)}  # HybridForward.conv_in_gemv
HEAD_NORM_GEMVS = ("gemv_residual_headnorm_m1", "gemv_residual_headnorm_m1p4")  # HybridForward.rule_norm_in_gemv
# The one-row o / out GEMVs' builds asking L2 for the layer's router (HybridForward.router_prefetch).
ROUTER_PREFETCH_GEMVS = ("gemv_residual_headnorm_m1p4n", "gemv_residual_m1p4n")
RULE_SPLITS = (2, 4, 8)  # deltanet_rule_s{n}'s builds, where a block keeps whole warps (numba_kernels/deltanet.py)
MOE_RULE_SPLITS = 2  # HybridForward.rule_splits of a MoE hybrid
SPLIT_RULE_ROWS = 4  # the most rows a decode step splits its delta rule for (batch 8 measured level or slower)
ATTENTION_HEAD_DIMS = (32, 64, 128, 256)


def deltanet_chunk_floats(config: HybridConfig) -> int:
    """Floats of ``deltanet_chunk_prep``'s scratch per (value head, chunk): cum | W | U | P."""
    c, dk, dv = DELTANET_CHUNK, config.linear_k_head_dim, config.linear_v_head_dim
    return c + c * dk + c * dv + c * c


def check_supported(config: HybridConfig, kv_dtype: str) -> None:
    """Reject shapes the kernels were not built for, naming the field."""
    c = config
    moe.check_supported(c)
    check_vocab(c.vocab_size)
    if c.head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"the CUDA hybrid runner supports head_dim {ATTENTION_HEAD_DIMS}, the model has {c.head_dim}")
    if c.linear_k_head_dim != c.linear_v_head_dim or c.linear_k_head_dim not in DELTANET_HEAD_DIMS:
        raise ValueError(f"the CUDA hybrid runner supports DeltaNet head dims k = v in {DELTANET_HEAD_DIMS}, "
                         f"the model has k {c.linear_k_head_dim}, v {c.linear_v_head_dim}")
    if c.conv_kernel != CONV_KERNEL:
        raise ValueError(f"the CUDA hybrid runner supports conv_kernel {CONV_KERNEL}, the model has {c.conv_kernel}")
    # The K of every GEMM (hidden: in_proj, qkv, gate_up, LM head; intermediate: down; value_dim: out;
    # q_size: o). The GEMVs and the fused decode GEMMs (numba_kernels/gemm.py make_gemv, make_mma_gemv)
    # load 8 K at a time in 16-byte vectors and mask weight rows past N, so K % 8 == 0 is all they
    # ask: every decode GEMM of a supported model runs fused, none falls back.
    for field, value in (("hidden_size", c.hidden_size), ("intermediate_size", c.intermediate_size),
                         ("value_dim", c.value_dim), ("q_size", c.q_size)):
        if value % 8:
            raise ValueError(f"the CUDA hybrid runner needs {field} divisible by 8, got {value}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")


class HybridBuffers:
    def __init__(self, device: rt.Device, config: HybridConfig, *, page_size: int, num_pages: int, max_batch: int,
                 max_context: int, max_rows: int, kv_dtype: str, state_slots: int,
                 tensor_core_prefill: bool = False, chunked_rule: bool | None = None):
        """``chunked_rule`` (default ``HybridForward.chunked_rule``): carve the chunked delta rule's
        scratch, ``ceil(rows / 64)`` chunks x value heads x ``deltanet_chunk_floats`` (about 1.3 KB a
        row a value head at head dim 128), so a forward can switch to that form."""
        c = config
        self.rows = R = max(max_rows, max_batch)
        self.max_pages = -(-max_context // page_size)
        self.splits = attention_splits(max_context)
        self.kv_itemsize = KV_DTYPES[kv_dtype]
        self.kv_layers = len(c.attention_layers)
        self.layer_elems = 2 * c.num_kv_heads * page_size * c.head_dim
        self.page_elems = self.kv_layers * self.layer_elems
        self.logit_rows = max_batch
        cells = c.num_heads * max(max_batch * self.splits["decode"], R * self.splits["prefill"])
        images = LaneSlots(max_batch, state_slots).physical  # the checkpoint slots and each lane's two
        f32 = 4
        plan = {
            "x": R * c.hidden_size * f32, "h": R * c.hidden_size * f32, "delta": R * c.hidden_size * f32,
            "proj": R * c.in_proj_size * f32, "mixed": R * c.conv_dim * f32, "core": R * c.value_dim * f32,
            # prefill's delta rule: normalised q|k, beta|decay per head, the ungated output
            "qk": R * 2 * c.key_dim * f32, "gates": R * 2 * c.linear_num_v_heads * f32, "o_raw": R * c.value_dim * f32,
            # q rows are (heads + 2 kv_heads) * head_dim wide: the layout the prefill kernel reads.
            "qkv": R * c.qkv_size * f32, "q": R * (c.q_size + 2 * c.kv_size) * f32, "gate": R * c.q_size * f32,
            "attn": R * c.q_size * f32, "attn_raw": R * c.q_size * f32,
            "gate_up": R * 2 * c.intermediate_size * f32, "act": R * c.intermediate_size * f32,
            "part_o": cells * c.head_dim * f32, "part_ml": cells * 2 * f32,
            **sampler_regions(max_batch, c.vocab_size),
            "cos": max_context * c.rotary_dim // 2 * f32, "sin": max_context * c.rotary_dim // 2 * f32,
            "kv": max(1, num_pages * self.page_elems * self.kv_itemsize),
            "states": max(1, images * c.state_floats * f32),
        }
        if chunked_rule is None:
            chunked_rule = HybridForward.chunked_rule
        if chunked_rule:
            chunks = -(-R // DELTANET_CHUNK)
            plan["chunks"] = chunks * c.linear_num_v_heads * deltanet_chunk_floats(c) * f32
        if LINEAR in c.layer_types:  # deltanet_step's tickets, one a (lane, key head), zero between launches
            plan["step_tickets"] = max_batch * c.linear_num_k_heads * 4
            # deltanet_rule_s's: one a (lane, value head), and each split's sum of squares
            plan["rule_tickets"] = max_batch * c.linear_num_v_heads * 4
            plan["rule_partials"] = max_batch * c.linear_num_v_heads * max(RULE_SPLITS) * f32
        if FULL in c.layer_types:  # gated_attention_merged's, one a (lane, query head)
            plan["attention_tickets"] = max_batch * c.num_heads * 4
        if MOE in c.mlp_types:
            plan["moe"] = moe.CudaMoe.scratch_bytes(c, R)
        if tensor_core_prefill:
            plan.update(tensor_core_regions(R, max(c.hidden_size, c.intermediate_size, c.q_size, c.value_dim)))
        carve_workspace(self, device, plan, R, max_batch)
        self.state_slots = DeviceStates(device, self.states, c, images)
        cos, sin = cos_sin_tables(base_inverse_frequencies(c.rope_theta, c.rotary_dim), max_context)
        self._tables = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))  # alive until copied

    def init(self, stream) -> None:
        rt.copy_h2d(self.cos, self._tables[0], stream)
        rt.copy_h2d(self.sin, self._tables[1], stream)
        regions = (self.counts, self.kv, self.states) + tuple(
            getattr(self, name) for name in ("step_tickets", "rule_tickets", "attention_tickets", "moe")
            if hasattr(self, name))
        for region in regions:  # the tickets (the fused kernels', the MoE scratch's) must start at zero
            rt.memset32(region, 0, region.nbytes // 4, stream)
        rt.synchronize(stream)
        self._tables = None


class HybridForward(Forward):
    """Enqueues the launches of one step; reads inputs and weights only from static addresses."""

    # Prefill's delta rule in the chunked form (deltanet_chunk_prep + deltanet_chunk_scan) instead of
    # the per-token scan. Off until timed on the GPU (tools/bench_deltanet_gpu.py, docs/hybrid.md);
    # set it before the HybridBuffers are built (they carve its scratch then), or per instance after
    # building buffers with ``chunked_rule=True``.
    chunked_rule = False
    # A decode step's conv and delta rule in one launch (``deltanet_step``) instead of two
    # (``deltanet_conv`` + ``deltanet_rule``): the same to fp32 rounding (bit for bit in the simulator). Off:
    # on an H100 it gained nothing (tools/gpu_bench_hybrid.py --fused-step-ablation, docs/benchmarks.md).
    fused_step = False
    # A decode step's gated attention and its split merge in one launch (``gated_attention_merged``: the
    # last split of each (row, head) merges, as ``gated_combine`` would): bit for bit the pair in the
    # simulator. Off: on an H100 it measured level or slower (tools/gpu_bench_hybrid.py
    # --merged-attention-ablation, docs/benchmarks.md).
    merged_attention = False
    # A decode step of at most SPLIT_RULE_ROWS rows runs its delta rule with each head's state columns
    # split over this many blocks (``deltanet_rule_s{n}``, one of RULE_SPLITS; 0: ``deltanet_rule``, a
    # block a head), each loading its columns before the grid wait. Set per model in __init__: on an
    # H100 (three runs each, tools/gpu_bench_hybrid.py --rule-splits-ablation 2,4) two splits took the
    # 35B-A3B's batch-1 decode 288.7 -> 296.7 tok/s and batch 4 795.8 -> 805.9 (batch 8 -0.6%), but
    # the 27B's batch 1 -1% and batch 8 -1.3%: its steps are the weights' stream, which the early
    # state loads only share; the MoE model's steps are latency, where they fill idle memory.
    rule_splits = 0
    # A decode step of one or two rows (the fp32 GEMV's) runs each DeltaNet conv in its in_proj GEMV's
    # epilogue (``gemv_normed_conv_m{rows}``, numba_kernels/gemm.py) instead of a ``deltanet_conv``
    # launch: the same arithmetic on the same sums, one launch a layer fewer. Not with ``fused_step``,
    # whose kernel convolves itself.
    conv_in_gemv = True
    # Where a one-row decode step's delta rule is split (``rule_splits``), the rule leaves its outputs
    # unscaled (``deltanet_rule_s{n}u``) and the out GEMV applies each head's gated RMSNorm as it loads
    # them (``gemv_residual_headnorm_m1[p4]``, numba_kernels/gemm.py): the same bits, without the rule's
    # ticket and last block. H100, 35B-A3B, GPU ms a step (tools/gpu_bench_hybrid.py --rule-norm-ablation,
    # two runs): b1 2.88 -> 2.87; at two rows (a build since dropped) 4.13 -> 4.14.
    rule_norm_in_gemv = True
    # A decode step's q/k norms, RoPE and KV append run inside its split attention (``gated_attention_roped``,
    # numba_kernels/gated_attention.py: the first round of keys and what the step does not write loaded
    # before the grid wait): the same bits, one launch a layer fewer. ``merged_attention`` keeps the
    # three-launch form.
    roped_attention = True
    # Bytes of a MoE layer's router weights (1 MiB on a 35B-A3B) that a one-row step's o / out GEMV asks
    # L2 for at its tail (its ``n`` build): the router GEMM's blocks, which cannot start until the GEMV's
    # leave their SMs, then load from L2. 0: off. An H200's 35B-A3B batch-1 step: level with the
    # tensor-core router (2.40 -> 2.41 ms of GPU time) and with the fp32 GEMV one (2.36 and 2.36;
    # tools/gpu_bench_hybrid.py --router-prefetch-ablation 1, docs/benchmarks.md).
    router_prefetch = 0
    # The shortest split (keys) of a decode step's gated attention; ``decode_split`` takes MIN_SPLIT-key
    # splits, as many as the grid holds, unless this is longer or ``decode_blocks`` caps the splits.
    # H100, 35B-A3B, GPU ms a step (tools/gpu_bench_hybrid.py --attention-split-ablation): at 512 keys
    # 32 (the default) b1 2.85, 64 2.89, 96 2.94, 128 3.00; b8 5.53, 5.57, 5.56, 5.60.
    min_decode_split = MIN_SPLIT
    # The most blocks (rows x query heads x splits) of a decode step's attention (0: no cap): thousands of
    # 32-key blocks cost a batch at long contexts. H100, GPU ms a step without -> with 4096 (2048)
    # (--attention-blocks-ablation): 35B-A3B b8/2048 7.01 -> 6.95 (6.93), b8/8192 9.56 -> 9.37 (9.39),
    # b4/8192 6.43 -> 6.43 (6.30), b1 level; 27B b8/2048 32.56-32.62 -> 32.33 (32.29). 2048 would cut
    # b8 at 512 keys to 64-key splits (5.53 -> 5.57 above); 4096 leaves every step of 512 keys as it was.
    decode_blocks = 4096

    def __init__(self, kernels: rt.Kernels, config: HybridConfig, weights: dict[str, rt.DevicePtr],
                 buffers: HybridBuffers, *, page_size: int, kv_dtype: str, lt=None):
        super().__init__(kernels, config, weights, buffers, page_size=page_size, kv_dtype=kv_dtype, lt=lt)
        c = config
        dk, dv = c.linear_k_head_dim, c.linear_v_head_dim
        self.rule_name = f"deltanet_rule_k{dk}_v{dv}"
        self.step_name = f"deltanet_step_k{dk}_v{dv}"
        self.split_rule_names = {n: f"deltanet_rule_s{n}_k{dk}_v{dv}" for n in RULE_SPLITS
                                 if f"deltanet_rule_s{n}_k{dk}_v{dv}" in kernels.entries}  # whole warps a block
        # the builds that leave their outputs for the out GEMV to scale (rule_norm_in_gemv)
        self.unscaled_rule_names = {n: f"deltanet_rule_s{n}u_k{dk}_v{dv}" for n in RULE_SPLITS}
        if MOE in c.mlp_types and MOE_RULE_SPLITS in self.split_rule_names:
            self.rule_splits = MOE_RULE_SPLITS
        # A MoE model's one-row o projections (its 2048 rows: every block resident) hold their first four
        # steps before the wait, during the delta rule or attention: an H100's 35B-A3B batch-1 step
        # 3.01-3.02 -> 2.97-2.98 ms of GPU time (tools/gpu_bench_hybrid.py --preload-o-ablation, two runs).
        self.preload_o = MOE in c.mlp_types
        self.attention_prefetch = 0.0  # decode_attention's o prefetch: the gated attention kernels have none
        # A dense MLP's GEMMs ask L2 for the next GEMM's first weights (decode_layers) up to 6 rows: the 27B
        # on an H100, GPU ms a step without -> with (tools/gpu_bench_hybrid.py --gemm-prefetch-ablation):
        # b3 23.72 -> 22.85, b4 24.28 -> 23.41-23.43, b6 25.53 -> 24.79-24.83, but b8 31.39-31.40 -> 31.51-31.56.
        self.gemm_prefetch = {matrix: {rows: nbytes for rows, nbytes in table.items() if rows <= 6}
                              for matrix, table in GEMM_PREFETCH.items()}
        self.prefill_rule_names = (f"deltanet_prep_k{dk}", f"deltanet_scan_k{dk}_v{dv}", f"deltanet_gated_norm_v{dv}")
        self.chunked_rule_names = (f"deltanet_chunk_prep_k{dk}_v{dv}", f"deltanet_chunk_scan_k{dk}_v{dv}")
        self.qk_name = f"gated_qk_rope_{kv_dtype}"
        self.gated_attention_name = f"gated_attention_d{c.head_dim}_{kv_dtype}"
        self.merged_attention_name = f"gated_attention_merged_d{c.head_dim}_{kv_dtype}"
        self.roped_attention_name = f"gated_attention_roped_d{c.head_dim}_{kv_dtype}"
        # Prefill attention on the tensor cores where a variant exists (bf16 pool; forward.PREFILL_ATTENTION).
        flash = PREFILL_ATTENTION.get(c.head_dim, f"prefill_attention_d{c.head_dim}")
        self.flash_name = flash if kv_dtype == "bf16" and flash in kernels.entries else None
        self.state_offset = layer_offsets(c)
        self.kv_index = {layer: i for i, layer in enumerate(c.attention_layers)}
        self.conv_floats = (c.conv_kernel - 1) * c.conv_dim
        self.moe = moe.CudaMoe(kernels, c, buffers.moe, buffers.rows) if MOE in c.mlp_types else None
        self.chain_norm = False  # the mixers' and MoE's GEMMs still normalise their own inputs

    def kernel_names(self) -> list[str]:
        # The dense GEMM, norm, LM-head and sampler kernels; not its attention (other head shapes).
        dense_only = {self.attention_name, self.rope_name, "attention_combine", self.decode_attention_name}
        names = [n for n in super().kernel_names() if n not in dense_only and n in self.k.entries]
        names += [name for name in CONV_GEMVS.values() if name in self.k.entries]
        names += [name for name in (*self.unscaled_rule_names.values(), *HEAD_NORM_GEMVS, *ROUTER_PREFETCH_GEMVS)
                  if name in self.k.entries]
        names += ["deltanet_conv", self.rule_name, *self.split_rule_names.values(), self.step_name,
                  *self.prefill_rule_names, *self.chunked_rule_names,
                  self.qk_name, self.gated_attention_name, self.merged_attention_name, "gated_combine"]
        names += [self.roped_attention_name] if self.roped_attention_name in self.k.entries else []
        names += moe.CudaMoe.kernel_names() if self.moe else []
        return names + (["sigmoid_gate", self.flash_name] if self.flash_name else [])

    def layers(self, rows: int, stream, outputs: str = "all", decode: bool = False) -> None:
        """Hidden states of ``rows`` input rows, final norm applied, into ``buffers.h``.

        ``decode``: each row is one lane's next token; else the rows are one prefill sequence.
        ``outputs`` (``forward.OUTPUTS``) "none" (a prefill sub-chunk whose logits nobody reads): the
        pass stops after the last layer's mixer, which still writes its K/V or recurrent state; that
        layer's MLP and the final norm feed only ``h``. "last" runs every row to the end."""
        c, b, w, k = self.c, self.b, self.w, self.k
        eps = float(c.rms_norm_eps)
        threads = norm_threads(rows)
        k["embed"].launch((-(-c.hidden_size // 256), rows), (256,),
                          (b.x, w["embed"], b.inputs.d_tokens, c.hidden_size), stream)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            if i == 0:
                k["rmsnorm"].launch((rows,), (threads,), (b.h, b.x, w[p + "attn_norm"], c.hidden_size, eps), stream)
            else:
                k["add_rmsnorm"].launch((rows,), (threads,),
                                        (b.x, b.delta, b.h, w[p + "attn_norm"], c.hidden_size, eps), stream)
            if c.layer_types[i] == LINEAR:
                self.deltanet(i, rows, decode, stream)
            else:
                self.attention(i, rows, stream)
            if outputs == "none" and i == c.num_layers - 1:
                return
            k["add_rmsnorm"].launch((rows,), (threads,), (b.x, b.delta, b.h, w[p + "mlp_norm"], c.hidden_size, eps),
                                    stream)
            if c.mlp_types[i] == DENSE:
                self.dense_mlp(p, rows, stream)
            else:
                self.moe.forward(b.delta, b.h, w, i, rows, stream)
        k["add_rmsnorm"].launch((rows,), (threads,), (b.x, b.delta, b.h, w["final_norm"], c.hidden_size, eps), stream)

    def deltanet(self, layer: int, rows: int, decode: bool, stream) -> None:
        c, b, w = self.c, self.b, self.w
        p = f"layers.{layer}."
        self.matmul(b.proj, b.h, w[p + "in_proj"], rows, c.in_proj_size, c.hidden_size, stream)
        self.deltanet_core(layer, rows, decode, stream)
        self.matmul(b.delta, b.core, w[p + "out"], rows, c.hidden_size, c.value_dim, stream)

    def conv_gemv(self, rows: int) -> rt.Kernel | None:
        """The in_proj GEMV that also runs the conv (``conv_in_gemv``), where a decode step of ``rows``
        rows has one."""
        name = CONV_GEMVS.get(rows)
        if not self.conv_in_gemv or self.fused_step or name not in self.k.entries:
            return None
        return self.k[name] if DECODE_GEMMS["qkv"][rows] == "fp32" else None

    def head_norm_gemv(self, rows: int) -> rt.Kernel | None:
        """The out GEMV that finishes the split rule's norm (``rule_norm_in_gemv``), where a decode step of
        ``rows`` rows has one: one row, a split rule, both builds there."""
        if not (self.rule_norm_in_gemv and rows == 1 and self.rule_splits and not self.fused_step
                and self.unscaled_rule_names[self.rule_splits] in self.k.entries):
            return None
        name = HEAD_NORM_GEMVS[1] if self.preload_o else HEAD_NORM_GEMVS[0]  # as Forward.preload_o
        return self.k[name] if name in self.k.entries else None

    def head_normed_out(self, layer: int, rows: int, kernel: rt.Kernel, stream,
                        then: rt.DevicePtr | None = None) -> None:
        """x += (``core`` with each head's gated RMSNorm) @ out.T, the norm from ``rule_partials``; with
        ``then`` (the layer's router: ``router_prefetch``) the kernel's ``n`` build asks L2 for its first bytes."""
        c, b, w = self.c, self.b, self.w
        n, k = c.hidden_size, c.value_dim
        name, ahead = self.next_build(kernel.name, then, self.router_prefetch)
        kernel = self.k[name]
        blocks = -(-n // kernel.meta["cols"])
        args = (b.x, b.core, w[f"layers.{layer}.out"], b.cos, rows, n, k, n, float(c.rms_norm_eps),
                b.rule_partials, self.rule_splits, c.linear_v_head_dim)
        if ahead:
            args += (then, prefetch_bytes(ahead, blocks))
        kernel.launch((blocks,), (kernel.meta["threads"],), args, stream)

    def in_proj_conv(self, layer: int, rows: int, kernel: rt.Kernel, stream) -> None:
        """x -> ``proj`` (z, b, a) and ``mixed`` (the conv's SiLU'd output), the conv tails moved on."""
        c, b, w = self.c, self.b, self.w
        p = f"layers.{layer}."
        n, k = c.in_proj_size, c.hidden_size
        kernel.launch((-(-n // kernel.meta["cols"]),), (kernel.meta["threads"],),
                      (b.proj, b.x, w[p + "in_proj"], w[p + "attn_norm"], rows, n, k, n, float(c.rms_norm_eps),
                       b.mixed, b.states.at(self.state_offset[layer] * 4), c.state_floats, b.inputs.d_state_in,
                       b.inputs.d_state_out, c.conv_dim, w[p + "conv"]), stream)

    def deltanet_core(self, layer: int, rows: int, decode: bool, stream, convolved: bool = False,
                      unscaled: bool = False) -> None:
        """``proj`` -> ``core``: the conv (tail updated) and the delta rule, per lane or over one sequence
        (a decode step's in one launch with ``fused_step``; ``convolved``: the in_proj GEMV did the
        conv, ``mixed`` holds it; ``unscaled``: the split rule leaves its gated RMSNorm to the
        ``head_norm_gemv`` after it)."""
        c, b, w, k = self.c, self.b, self.w, self.k
        p = f"layers.{layer}."
        seqs, seq_rows = (rows, 1) if decode else (1, rows)
        slot_floats = c.state_floats
        conv_state = b.states.at(self.state_offset[layer] * 4)
        state_rows = (b.inputs.d_state_in, b.inputs.d_state_out)  # the slots each sequence reads, writes
        if decode and self.fused_step:
            step = k[self.step_name]
            step.launch((c.linear_num_v_heads, seqs), (step.meta["threads"],),
                        (b.proj, b.core, conv_state, slot_floats, *state_rows, c.linear_num_k_heads,
                         c.linear_num_v_heads, c.in_proj_size, w[p + "conv"], w[p + "dt_bias"], w[p + "A_log"],
                         w[p + "linear_norm"], float(c.rms_norm_eps), b.step_tickets), stream)
            return
        if not convolved:
            conv = k["deltanet_conv"]
            conv.launch((-(-c.conv_dim // conv.meta["threads"]), seqs), (conv.meta["threads"],),
                        (b.mixed, b.proj, c.in_proj_size, conv_state, slot_floats, *state_rows, seq_rows,
                         c.conv_dim, w[p + "conv"]), stream)
        state = conv_state.at(self.conv_floats * 4)
        if decode and self.rule_splits and rows <= SPLIT_RULE_ROWS:
            rule = k[(self.unscaled_rule_names if unscaled else self.split_rule_names)[self.rule_splits]]
            args = (b.mixed, b.proj, b.core, state, slot_floats, *state_rows, c.linear_num_k_heads,
                    c.linear_num_v_heads, c.in_proj_size, w[p + "dt_bias"], w[p + "A_log"], w[p + "linear_norm"],
                    float(c.rms_norm_eps), b.rule_partials)
            rule.launch((c.linear_num_v_heads, seqs, self.rule_splits), (rule.meta["threads"],),
                        args if unscaled else args + (b.rule_tickets,), stream)
        elif decode:
            rule = k[self.rule_name]
            rule.launch((c.linear_num_v_heads, seqs), (rule.meta["threads"],),
                        (b.mixed, b.proj, b.core, state, slot_floats, *state_rows, seq_rows,
                         c.linear_num_k_heads, c.linear_num_v_heads, c.in_proj_size, w[p + "dt_bias"],
                         w[p + "A_log"], w[p + "linear_norm"], float(c.rms_norm_eps)), stream)
        else:
            self.prefill_rule(p, state, rows, stream)

    def prefill_rule(self, p: str, state: rt.DevicePtr, rows: int, stream) -> None:
        """The delta rule over one sequence of ``rows`` tokens: the row-parallel parts (q/k norms,
        gates; the gated norm) in their own launches, so the sequential scan does only the recurrence.
        With ``chunked_rule`` the scan is two launches of the chunked form: every chunk's W, U and P
        at once, then the walk over the chunks (numba_kernels/deltanet.py)."""
        c, b, w, k = self.c, self.b, self.w, self.k
        nk, nv = c.linear_num_k_heads, c.linear_num_v_heads
        prep, scan, norm = (k[name] for name in self.prefill_rule_names)
        prep.launch((rows, nk + 1), (prep.meta["threads"],),
                    (b.qk, b.gates, b.mixed, b.proj, nk, nv, c.in_proj_size, w[p + "dt_bias"], w[p + "A_log"]), stream)
        if self.chunked_rule:
            if not hasattr(b, "chunks"):
                raise RuntimeError("chunked_rule needs HybridBuffers built with chunked_rule=True (its scratch)")
            chunk_prep, chunk_scan = (k[name] for name in self.chunked_rule_names)
            chunk_prep.launch((nv, -(-rows // chunk_prep.meta["chunk"]), 1), (chunk_prep.meta["threads"],),
                              (b.chunks, b.qk, b.gates, b.mixed, b.proj, c.in_proj_size, w[p + "dt_bias"],
                               w[p + "A_log"], rows, nk, nv), stream)
            chunk_scan.launch((nv, chunk_scan.meta["splits"], 1), (chunk_scan.meta["threads"],),
                              (b.chunks, b.qk, b.o_raw, state, c.state_floats, b.inputs.d_state_in, rows, nk, nv),
                              stream)
        else:
            scan.launch((nv, scan.meta["splits"], 1), (scan.meta["threads"],),
                        (b.qk, b.gates, b.mixed, b.o_raw, state, c.state_floats, b.inputs.d_state_in, rows, nk, nv),
                        stream)
        norm.launch((rows, nv), (norm.meta["threads"],),
                    (b.core, b.o_raw, b.proj, c.in_proj_size, nk, nv, w[p + "linear_norm"], float(c.rms_norm_eps)),
                    stream)

    def attention(self, layer: int, rows: int, stream) -> None:
        c, b, w = self.c, self.b, self.w
        p = f"layers.{layer}."
        self.matmul(b.qkv, b.h, w[p + "qkv"], rows, c.qkv_size, c.hidden_size, stream)
        self.gated_attend(layer, rows, stream)
        self.matmul(b.delta, b.attn, w[p + "o"], rows, c.hidden_size, c.q_size, stream)

    def gated_attend(self, layer: int, rows: int, stream, decode: bool = False) -> None:
        """``qkv`` -> ``attn``: query/gate split, q/k norm, RoPE and KV append, then gated attention."""
        c, b, w, k = self.c, self.b, self.w, self.k
        inp = b.inputs
        p = f"layers.{layer}."
        H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
        layer_kv = b.kv.at(self.kv_index[layer] * b.layer_elems * b.kv_itemsize)
        if decode and self.roped_attention and not self.merged_attention and self.roped_attention_name in k.entries:
            self.roped_gated_attention(layer, layer_kv, rows, stream)
            return
        k[self.qk_name].launch(
            (rows, H + 2 * KV), (D,),
            (b.qkv, b.q, b.gate, w[p + "q_norm"], w[p + "k_norm"], b.cos, b.sin, layer_kv, b.page_elems,
             inp.d_page_tables, b.max_pages, inp.d_row_table, inp.d_positions, H, KV, D, c.rotary_dim // 2,
             self.page_size, float(c.rms_norm_eps)), stream)
        if self.flash_name and rows > inp.lanes.size:
            self.prefill_gated_attention(layer_kv, rows, stream)
        else:
            self.decode_gated_attention(layer_kv, rows, stream, decode)

    def roped_gated_attention(self, layer: int, layer_kv: rt.DevicePtr, rows: int, stream) -> None:
        """A decode step's ``qkv`` -> ``attn``: ``gated_attention_roped`` (norms, RoPE, the append and the
        split partials, the gates into ``gate``), then ``gated_combine``."""
        c, b, w, inp = self.c, self.b, self.w, self.b.inputs
        p = f"layers.{layer}."
        H = c.num_heads
        n_splits = self.n_splits(rows, decode=True)
        kernel = self.k[self.roped_attention_name]
        kernel.launch((H, rows, n_splits), (kernel.meta["threads"],),
                      (b.qkv, layer_kv, b.page_elems, inp.d_page_tables, b.max_pages, inp.d_row_table, inp.d_positions,
                       b.part_o, b.part_ml, H, c.num_kv_heads, self.page_shift, inp.d_split, n_splits, self.scale,
                       b.gate, w[p + "q_norm"], w[p + "k_norm"], b.cos, b.sin, c.rotary_dim // 2,
                       float(c.rms_norm_eps)), stream)
        self.gated_combine(rows, n_splits, stream)

    def decode_split(self, length: int, rows: int) -> int:
        """``gated_attention`` (a block per query head) keeps splits of MIN_SPLIT keys, as many as the grid
        has, up to ``decode_blocks`` blocks in all: the dense kernel's block-count policy (320 blocks) made
        the 27B's decode slower (b8 352.9 -> 327.3 tok/s)."""
        splits = MAX_DECODE_SPLITS
        if self.decode_blocks:
            splits = max(1, self.decode_blocks // (rows * self.c.num_heads))
        return max(split_length(length, splits), self.min_decode_split)

    def decode_gated_attention(self, layer_kv: rt.DevicePtr, rows: int, stream, decode: bool) -> None:
        """Split-K partials then their merge with the output gate: any head_dim and pool dtype."""
        c, b, k, inp = self.c, self.b, self.k, self.b.inputs
        H, KV = c.num_heads, c.num_kv_heads
        n_splits = self.n_splits(rows, decode)
        args = (b.q, layer_kv, b.page_elems, inp.d_page_tables, b.max_pages, inp.d_row_table, inp.d_positions,
                b.part_o, b.part_ml, H, KV, self.page_shift, inp.d_split, n_splits, self.scale)
        if decode and self.merged_attention:  # each (row, head)'s last split merges them: no combine launch
            attention = k[self.merged_attention_name]
            attention.launch((H, rows, n_splits), (attention.meta["threads"],),
                             args + (b.attn, b.gate, b.attention_tickets), stream)
            return
        attention = k[self.gated_attention_name]
        attention.launch((H, rows, n_splits), (attention.meta["threads"],), args, stream)
        self.gated_combine(rows, n_splits, stream)

    def gated_combine(self, rows: int, n_splits: int, stream) -> None:
        """``attn`` = the split partials of ``rows`` rows merged, times ``sigmoid(gate)``."""
        c, b, inp = self.c, self.b, self.b.inputs
        H, D = c.num_heads, c.head_dim
        self.k["gated_combine"].launch((H, rows), (D,), (b.attn, b.gate, b.part_o, b.part_ml, inp.d_positions, H,
                                                         n_splits, D, inp.d_split), stream)

    def prefill_gated_attention(self, layer_kv: rt.DevicePtr, rows: int, stream) -> None:
        """Prefill rows on the tensor cores (``prefill_attention*.py``, bf16 pool), then the gate."""
        c, b, inp = self.c, self.b, self.b.inputs
        kernel = self.k[self.flash_name]
        scale_log2 = float(c.head_dim ** -0.5 * np.log2(np.e))  # the kernel's softmax runs in exp2
        kernel.launch(prefill_attention_grid(kernel.meta, c.num_heads, rows, self.k.device.sm_count),
                      (kernel.meta["threads"],),
                      (b.q, layer_kv, b.page_elems, inp.d_page_tables, b.max_pages, inp.d_row_table,
                       inp.d_positions, b.attn_raw, rows, c.num_heads, c.num_kv_heads, self.page_shift,
                       scale_log2), stream)
        count = rows * c.q_size
        self.k["sigmoid_gate"].launch((-(-count // 256),), (256,), (b.attn, b.attn_raw, b.gate, count), stream)

    def dense_mlp(self, p: str, rows: int, stream) -> None:
        c, b, w, k = self.c, self.b, self.w, self.k
        self.matmul(b.gate_up, b.h, w[p + "gate_up"], rows, 2 * c.intermediate_size, c.hidden_size, stream)
        k["silu_mul"].launch((-(-c.intermediate_size // 256), rows), (256,), (b.act, b.gate_up, c.intermediate_size),
                             stream)
        self.matmul(b.delta, b.act, w[p + "down"], rows, c.hidden_size, c.intermediate_size, stream)

    def overlaps(self, rows: int) -> bool:
        """Every row count: the hybrid's mixer and MoE kernels are short, and overlapping them gains
        at batch 8 too (35B-A3B 2.5-3.3%, 27B level; docs/benchmarks.md, "Hybrid models")."""
        return self.overlap

    def decode_depths(self) -> tuple[int, ...]:
        """One depth: ``gated_attention`` spreads a row's keys over every split the grid has."""
        return (self.n_splits(1, decode=True),)

    def decode_layers(self, rows: int, stream, depth: int | None = None) -> None:
        """Decode rows through every layer, leaving the residual stream (not normalised) in ``buffers.x``.

        ``Forward.decode_layers``' fusions around the hybrid mixers: each RMSNorm rides in the GEMM
        that consumes it, each residual add in the GEMM that produces it. in_proj is a normed store
        like qkv and out a residual like o, so they run under those entries of ``DECODE_GEMMS`` (and of
        ``gemm_prefetch``: a dense MLP's o, gate/up and down ask L2 for the next GEMM's first weights).
        ``depth`` is always the one of ``decode_depths``."""
        c, b, w = self.c, self.b, self.w
        self.k["embed"].launch((-(-c.hidden_size // 256), rows), (256,),
                               (b.x, w["embed"], b.inputs.d_tokens, c.hidden_size), stream)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            dense = c.mlp_types[i] == DENSE
            router = w[p + "router"] if self.router_prefetch and rows == 1 and not dense else None
            if c.layer_types[i] == LINEAR:
                conv_gemv = self.conv_gemv(rows)
                if conv_gemv:
                    self.in_proj_conv(i, rows, conv_gemv, stream)
                else:
                    self.decode_gemm("qkv", b.proj, b.x, w[p + "in_proj"], rows, c.in_proj_size, c.hidden_size,
                                     stream, norm=w[p + "attn_norm"], then=w[p + "out"])
                out_gemv = self.head_norm_gemv(rows)
                self.deltanet_core(i, rows, True, stream, convolved=bool(conv_gemv), unscaled=bool(out_gemv))
                if out_gemv:
                    self.head_normed_out(i, rows, out_gemv, stream, then=router)
                else:
                    self.decode_gemm("o", b.x, b.core, w[p + "out"], rows, c.hidden_size, c.value_dim, stream,
                                     then=w[p + "gate_up"] if dense else router,
                                     ask=self.router_prefetch if router else None)
            else:
                self.decode_gemm("qkv", b.qkv, b.x, w[p + "qkv"], rows, c.qkv_size, c.hidden_size, stream,
                                 norm=w[p + "attn_norm"], then=w[p + "o"])
                self.gated_attend(i, rows, stream, decode=True)
                self.decode_gemm("o", b.x, b.attn, w[p + "o"], rows, c.hidden_size, c.q_size, stream,
                                 then=w[p + "gate_up"] if dense else router,
                                 ask=self.router_prefetch if router else None)
            if dense:
                self.decode_gemm("gate_up", b.act, b.x, w[p + "gate_up"], rows, c.intermediate_size, c.hidden_size,
                                 stream, norm=w[p + "mlp_norm"], then=w[p + "down"])
                self.decode_gemm("down", b.x, b.act, w[p + "down"], rows, c.hidden_size, c.intermediate_size,
                                 stream, then=self.first_weights(i + 1))
            else:
                self.decode_moe(i, rows, stream)

    def first_weights(self, layer: int, rows: int = 1, chain: str = "") -> rt.DevicePtr:
        """``Forward.first_weights``, where a DeltaNet layer's first GEMM is its in_proj."""
        if layer < self.c.num_layers and self.c.layer_types[layer] == LINEAR:
            return self.w[f"layers.{layer}.in_proj"]
        return super().first_weights(layer, rows, chain)

    def decode_moe(self, layer: int, rows: int, stream) -> None:
        """x += MoE(rmsnorm(x) * mlp_norm): the router GEMM normalises x and leaves the normalised rows
        in ``h`` for the routing and the expert GEMMs; the combine adds into x (the next layer's GEMM
        normalises x itself). The router may ask L2 for that GEMM's first weights (``CudaMoe.next_prefetch``)."""
        c, b, w = self.c, self.b, self.w
        norm = (w[f"layers.{layer}.mlp_norm"], float(c.rms_norm_eps), b.h)
        self.moe.forward(b.x, b.x, w, layer, rows, stream, residual=True, norm=norm,
                         then=self.first_weights(layer + 1))

    def unfused_layers(self, rows: int, stream) -> None:
        """The prefill kernels with each row its own lane's sequence (``fused_decode`` off)."""
        self.layers(rows, stream, decode=True)
