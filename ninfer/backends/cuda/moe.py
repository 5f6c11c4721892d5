"""The sparse MoE block of a hybrid layer on the GPU: routing and grouped expert GEMMs on the device.

``y = sum_k p_k * expert_{e_k}(x) + sigmoid(shared_gate . x) * shared(x)`` for every row, as the
reference backend's ``HybridModel._moe`` computes it (softmax router in fp32, the ``top_k`` most
probable experts with ties to the lower id, weights renormalised when ``norm_topk_prob``).

Routing never leaves the device, so a decode step's MoE can be captured in a CUDA Graph:

1. router logits ``[rows, E]``: the tensor-core decode GEMM (``mma_gemv``, fp32-faithful) for up to
   8 rows, the tiled fp32 GEMM for prefill rows;
2. ``moe_topk`` (one warp a row): softmax, top-k, renormalisation, and the shared-expert gate
   ``sigmoid(shared_gate . x)``;
3. ``moe_plan`` (one block): the (row, slot) pairs sorted by expert and cut into chunks of at most
   ``chunk`` pairs of one expert; the shared expert's rows follow as chunks of expert -1;
4. ``moe_gate_up_*`` then ``moe_down_*``: one block per (chunk, output tile), so each distinct
   expert's weights are streamed once per chunk (once a step in decode, where a chunk holds all its
   rows); mma.sync with fp32-faithful split activations; the down epilogue scales by the pair weight;
5. ``moe_combine``: each row sums its k routed pairs in slot order plus its shared pair.

Weights are read under their canonical artifact names (``hybrid_weights.device_layout``: bf16
``router [E, H]``, ``experts.gate_up [E, 2I, H]``, ``experts.down [E, H, I]``, ``shared.gate_up
[2S, H]``, ``shared.down [H, S]``, ``shared_gate [1, H]``). Scratch is one region carved at
construction; addresses never change.
"""

from __future__ import annotations

from ninfer.backends.cuda import runtime as rt
from ninfer.models.hybrid import HybridConfig


class CudaMoe:
    """The MoE blocks of one hybrid model over a fixed scratch region (see the module docstring)."""

    @staticmethod
    def kernel_names() -> list[str]:
        """Every kernel ``forward`` may launch (load them before graph capture)."""
        raise NotImplementedError  # filled in with the kernels (numba_kernels/moe.py)

    @staticmethod
    def scratch_bytes(config: HybridConfig, max_rows: int) -> int:
        """Device bytes ``forward`` needs for up to ``max_rows`` rows (logits, plan, pair activations)."""
        raise NotImplementedError

    def __init__(self, kernels: rt.Kernels, config: HybridConfig, scratch: rt.DevicePtr, max_rows: int):
        """``scratch``: at least ``scratch_bytes(config, max_rows)`` bytes, owned by this object."""
        raise NotImplementedError

    def forward(self, y: rt.DevicePtr, x: rt.DevicePtr, weights: dict[str, rt.DevicePtr], layer: int, rows: int,
                stream) -> None:
        """Enqueue ``y[:rows, :hidden] = MoE_layer(x[:rows])`` (fp32 ``[rows, hidden]`` each, y fully
        written, x untouched) on ``stream``: no host sync, fixed addresses, capturable."""
        raise NotImplementedError
