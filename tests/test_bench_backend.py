"""`ninfer bench backend`: the reference runner timed end to end on a tiny artifact, the bytes a step
must move, and option errors that name the option. The CUDA run is marked `cuda` (GPU hosts only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ninfer.cli import main
from ninfer.commands import bench_backend, runner_timing
from ninfer.convert.random_model import PRESETS, make_random_artifact
from ninfer.models.dense import DenseConfig, tensor_names

TINY = PRESETS["tiny-qwen3"]  # max context 4096


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=0)
    return str(path)


def test_reference_cases_in_json(tiny, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "backend", tiny, "--batches", "1,2", "--contexts", "32,4096,9000", "--steps", "4",
                 "--prefill", "128", "--ttft", "16,64", "--engine-steps", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["backend"] == "reference" and report["model"] == tiny and report["copy_gb_s"] > 0
    # 9000 is past the model's 4096: skipped with a message; 4096 decodes just below the limit.
    assert report["skipped"] == ["context 9000: longer than the model's max context 4096"]
    assert "skipped: context 9000" in printed and "decoding at positions 4087..4095" in printed
    cases = {(r["batch"], r["context"]): r for r in report["decode"]}
    assert set(cases) == {(1, 32), (2, 32), (1, 4096), (2, 4096)}
    assert cases[(2, 4096)]["first_position"] == 4096 - 4 - runner_timing.DECODE_SLACK
    for r in cases.values():
        assert r["tok_s"] > 0 and r["step_ms"] > 0 and r["pct_roofline"] > 0 and r["achieved_gb_s"] > 0
        assert r["step_bytes"] > report["weight_bytes_per_step"]
        assert r["gpu_step_ms"] is None and r["pipelined_tok_s"] is None  # nothing to tell apart on the CPU
    assert cases[(2, 4096)]["step_bytes"] > cases[(2, 32)]["step_bytes"] > cases[(1, 32)]["step_bytes"]
    assert [(r["batch"], r["context"]) for r in report["engine"]] == [(1, 32), (2, 32)]
    assert all(r["tok_s"] > 0 and r["engine_host_us"] > 0 for r in report["engine"])
    assert report["prefill"]["tokens"] == 128 and report["prefill"]["tok_s"] > 0
    assert [r["prompt"] for r in report["ttft"]] == [16, 64] and all(r["ttft_ms"] > 0 for r in report["ttft"])
    assert "decode b=2 ctx=4096:" in printed and "% of roofline" in printed and "engine host time" in printed


def test_skips_leave_a_decode_only_run(tiny, capsys):
    assert main(["bench", "backend", tiny, "--batches", "1", "--contexts", "16", "--steps", "2", "--prefill", "0",
                 "--ttft", "", "--engine-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "decode b=1 ctx=16:" in out and "prefill" not in out and "TTFT" not in out and "engine-driven" not in out


def test_bytes_a_step_must_move():
    weights = sum(int(np.prod(shape)) * 4 for shape in tensor_names(TINY).values())  # tied: the embed is the head
    assert runner_timing.reference_weight_bytes_per_step(TINY) == weights
    kv_fp32 = TINY.num_layers * 2 * TINY.kv_size * 4
    assert runner_timing.decode_step_bytes(TINY, "reference", 3, 100) == weights + 3 * 100 * kv_fp32
    untied = DenseConfig.from_json({**TINY.to_json(), "tie_word_embeddings": False})
    assert "lm_head" in tensor_names(untied)
    # Untied: the head is read, the embedding table (as large) is not.
    assert runner_timing.reference_weight_bytes_per_step(untied) == weights


def test_decode_timing_takes_a_models_step_bytes_and_rewinds_its_recurrent_state(tmp_path):
    """tools/gpu_bench_hybrid.py's use: a hybrid runner refuses a pass that starts over at ``context``
    unless ``rewind`` forgets what its states summarise; ``step_bytes`` sets the roofline."""
    from ninfer.backends.reference import ReferenceRunner

    path = tmp_path / "hybrid.ninfer"
    make_random_artifact(path, "tiny-qwen3.5", seed=0)
    runner = ReferenceRunner(str(path), page_size=16, num_pages=8, max_batch=2, max_context=64)
    seen = []

    def forget():
        for lane in range(2):
            runner.write_state(lane, runner.read_state(lane), None)

    def step_bytes(batch, kv_tokens):
        seen.append((batch, kv_tokens))
        return 10**6

    def timed(**kw):  # pipelined by default, as the tool asks
        return runner_timing.bench_decode(runner, runner.info, 2, 16, 4, 1e9, **kw)

    timed(step_bytes=step_bytes, rewind=forget)
    with pytest.raises(ValueError, match="recurrent state summarises"):
        timed()  # the states hold 16 + 4 + 3 positions: the pass cannot start over at 16
    r = timed(step_bytes=step_bytes, rewind=forget)
    assert seen == [(2, 18)] * 2 and r["roofline_tok_s"] == pytest.approx(2 * 1e9 / 1e6)
    assert r["pct_roofline"] == pytest.approx(100 * 1e6 / 1e9 / (r["step_ms"] / 1e3))
    # Pipelined too (the hybrid runner's two StateImages a lane), over the rewound states.
    assert runner.info.pipelined_decode and r["pipelined_tok_s"] > 0 and r["pipelined_step_ms"] > 0


def test_cuda_weight_bytes_of_the_8b_shape():
    pytest.importorskip("cuda.bindings")
    from ninfer.convert.random_model import LARGE_PRESETS

    config = LARGE_PRESETS["qwen3-8b"]
    nbytes = runner_timing.weight_bytes_per_step(config)
    assert 15.0e9 < nbytes < 15.3e9  # bf16 matrices less the 1.24 GB embedding table (the head is untied)
    assert runner_timing.decode_step_bytes(config, "cuda", 8, 512) == nbytes + 8 * 512 * config.kv_bytes_per_token


@pytest.mark.parametrize("argv, message", [
    (["--batches", "1,16"], "batch 16 exceeds the maximum concurrency 8"),
    (["--batches", "0"], "a batch must be >= 1, got 0"),
    (["--device", "tpu"], "expected cpu or a CUDA device number"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--engine-steps", "4"], "--engine-steps must be 0 (skip) or >= 16, got 4"),
    (["--contexts", "512,x"], "expected comma-separated integers"),
])
def test_parse_errors_name_the_option(tiny, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "backend", tiny, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, devices, message", [
    (["--device", "0"], 0, "--device 0: no CUDA GPU is usable here"),
    (["--device", "3"], 1, "--device 3: this machine has 1 CUDA device(s), 0..0"),
    (["--random-weights", "qwen3-8b"], 0, "--random-weights makes its weights on the GPU, so it needs --device N"),
    (["--device", "0", "--random-weights", "qwen3-8b", "ARTIFACT"], 1, "an artifact or --random-weights, not both"),
    (["--device", "0", "--random-weights", "no-such-preset"], 1, "--random-weights"),
    (["/no/such.ninfer"], 0, "artifact /no/such.ninfer does not exist"),
])
def test_unrunnable_options_exit_2(tiny, monkeypatch, capsys, argv, devices, message):
    monkeypatch.setattr(bench_backend, "_cuda_devices", lambda: devices)
    argv = [tiny if a == "ARTIFACT" else a for a in argv]
    assert main(["bench", "backend", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer bench backend: ") and message in err


def test_hybrid_artifacts_are_refused(tmp_path, capsys):
    path = tmp_path / "hybrid.ninfer"
    make_random_artifact(path, "tiny-qwen3.5", seed=0)
    assert main(["bench", "backend", str(path)]) == 2
    assert "times the dense runners" in capsys.readouterr().err


@pytest.mark.cuda
def test_cuda_random_weights(tmp_path):
    config = tmp_path / "small.json"
    small = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=384,
                        num_layers=3, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                        rope_theta=1000000.0, max_position_embeddings=4096, qk_norm=True)
    config.write_text(json.dumps(small.to_json()))
    out = tmp_path / "bench.json"
    assert main(["bench", "backend", "--device", "0", "--random-weights", str(config), "--batches", "1,2",
                 "--contexts", "64,4096", "--steps", "4", "--prefill", "256", "--ttft", "64",
                 "--engine-steps", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "cuda" and report["copy_gb_s"] > 100
    assert len(report["decode"]) == 4 and report["startup"]["weights_bytes"] > 0
    for r in report["decode"]:
        assert r["tok_s"] > 0 and r["gpu_step_ms"] > 0 and r["pipelined_tok_s"] > 0 and r["pct_roofline"] > 0
    assert report["prefill"]["tok_s"] > 0 and report["ttft"][0]["ttft_ms"] > 0
