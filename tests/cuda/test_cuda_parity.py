"""CudaRunner against Hugging Face transformers on the parity_cuda fixtures (GPU only).

The fixtures (tests/fixtures/parity_cuda/, ``tools/make_parity_fixtures.py --set cuda``) are tiny
random Llama (head_dim 64, q/k/v biases, Llama 3 rope scaling, untied head) and Qwen3 (head_dim 128,
q/k norm, YaRN, tied) checkpoints with transformers' float32 logits and greedy tokens;
tests/test_parity.py replays the same goldens on the reference backend and checks that the CUDA
backend's gate accepts the configs. Here each checkpoint is converted by the product's HF converter
and replayed through ``parity_testing.replay_golden`` on ``CudaRunner``, decode graphs on and off,
prefill in sub-chunks of 16 rows (the 37-token prompt takes three), pages in reversed order:

- ``kv_dtype="f32"`` (``prefill_gemm="fp32"``): the backend is fp32 throughout, so it differs from
  transformers' float32 only by summation order. Greedy tokens must be identical and every logit
  within ``parity_testing.LOGIT_TOLERANCE`` (1e-4) x the largest |logit| of its row, the reference
  backend's tolerance (its largest error on these fixtures is 7.7e-6).
- ``kv_dtype="bf16"``: K and V are stored in bf16, and the tensor-core attention kernels that read
  them take q and the softmax probabilities in bf16 too. Rounding q, K, V and the probabilities to
  bf16 inside transformers' eager attention (an estimate made once in the fixture tool's venv, over
  the same teacher-forced sequences) moves the logits by up to 4.2e-2 x the row's largest |logit|
  on the Llama (median 9e-3; its attention, without q/k norm, is sharp) and 1.3e-2 on the Qwen3,
  so ``BF16_KV_TOLERANCE`` is 1e-1, about 2.4 times the worst estimate. Such an error can flip a greedy
  choice whose top-2 margin is small (the fixtures only promise 1e-2 in absolute terms), after which
  the sequences would no longer be comparable; so the replay is teacher-forced: every step is fed
  transformers' token, every step's logits are checked, and the runner's own tokens must match
  only where transformers' margin exceeds twice the tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from parity_testing import LOGIT_TOLERANCE, convert_fixtures, replay_golden  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "parity_cuda"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file())
BF16_KV_TOLERANCE = 1e-1
PAGE, MAX_CTX, PREFILL_ROWS = 16, 128, 16
NUM_PAGES = MAX_CTX // PAGE + 4
# Every page a lane may use, highest first: neither the identity order nor page 0.
PAGES = np.arange(NUM_PAGES, dtype=np.int32)[::-1][:MAX_CTX // PAGE].copy()
# mode -> (kv_dtype, cuda_graph, tolerance, teacher_forced)
MODES = {
    "f32-graph": ("f32", True, LOGIT_TOLERANCE, False),
    "f32-direct": ("f32", False, LOGIT_TOLERANCE, False),
    "bf16-graph": ("bf16", True, BF16_KV_TOLERANCE, True),
    "bf16-direct": ("bf16", False, BF16_KV_TOLERANCE, True),
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Each fixture checkpoint converted once by the product's HF converter."""
    return convert_fixtures(FIXTURES, NAMES, tmp_path_factory.mktemp("parity_cuda"))


def test_the_fixture_set_is_there():
    assert len(NAMES) >= 2, f"no parity_cuda fixtures under {FIXTURES}"


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logits_match_transformers(name, mode, artifacts):
    from ninfer.backends.cuda import CudaRunner

    kv_dtype, cuda_graph, tolerance, teacher_forced = MODES[mode]
    golden = np.load(FIXTURES / name / "golden.npz")
    prompts = sorted(k for k in golden.files if k.startswith("prompt_") and "logits" not in k)
    assert len(prompts) >= 3
    runner = CudaRunner(artifacts[name], page_size=PAGE, num_pages=NUM_PAGES, max_batch=1, max_context=MAX_CTX,
                        kv_dtype=kv_dtype, cuda_graph=cuda_graph, max_prefill_rows=PREFILL_ROWS,
                        prefill_gemm="fp32")
    try:
        for key in prompts:
            replay_golden(runner, golden, key.split("_")[1], PAGES, f"{name} [{mode}]", tolerance=tolerance,
                          teacher_forced=teacher_forced)
    finally:
        runner.close()
