"""Option validation and sampler resolution order: preset → process flags → request → greedy."""

from __future__ import annotations

import pytest

from ninfer.engine import EngineConfig, SamplingOverrides
from ninfer.engine.sampling import preset_for, resolve, validate_overrides

GENERATION = {
    "defaults": {"temperature": 0.6},
    "presets": {"thinking": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0},
                "non_thinking": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5}},
}


def test_preset_follows_the_initial_thinking_mode():
    assert preset_for(GENERATION, True)["top_p"] == 0.95
    assert preset_for(GENERATION, False)["presence_penalty"] == 1.5
    assert preset_for({"defaults": {"temperature": 0.6}}, False)["temperature"] == 0.6
    generic = preset_for(None, True)
    assert generic["temperature"] == 1.0 and generic["top_k"] == 0 and generic["frequency_penalty"] == 0.0


def test_flags_override_the_preset_and_the_request_overrides_flags():
    preset = preset_for(GENERATION, False)
    config = EngineConfig(temperature=0.3, top_k=5, seed=99)
    row = resolve(preset, config, SamplingOverrides(top_k=7, min_p=0.1))
    assert (row.temperature, row.top_p, row.top_k, row.min_p, row.presence_penalty) == (0.3, 0.8, 7, 0.1, 1.5)
    assert row.seed == 99  # the process seed when the request has none
    assert resolve(preset, config, SamplingOverrides(seed=-5)).seed == -5


def test_greedy_wins_last_and_seeds_are_fresh_without_one():
    preset = preset_for(GENERATION, True)
    row = resolve(preset, EngineConfig(greedy=True), SamplingOverrides(temperature=1.5))
    assert row.temperature == 0.0 and row.top_p == 0.95
    seeds = {resolve(preset, EngineConfig(), SamplingOverrides()).seed for _ in range(8)}
    assert len(seeds) == 8 and all(-(2**63) <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 2.5, "temperature"), ("top_p", 1.5, "top_p"), ("top_k", 21, "top_k"),
    ("min_p", -0.1, "min_p"), ("presence_penalty", 3.0, "presence_penalty"), ("seed", 2**63, "seed")])
def test_request_sampling_fields_are_range_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        validate_overrides(SamplingOverrides(**{field: value}))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_concurrency": 0}, "max_concurrency"), ({"max_concurrency": 9}, "max_concurrency"),
    ({"page_size": 12}, "page_size"), ({"prefill_chunk": 0}, "prefill_chunk"),
    ({"host_context_mib": -1}, "host_context_mib"), ({"top_k": 30}, "top_k")])
def test_engine_config_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_derived_capacities():
    c = EngineConfig(max_concurrency=2, max_pending_requests=3, max_context=1000, page_size=16)
    assert c.kv_pages == 63 and c.sequence_limit == 1000 and c.lifetime_capacity == 5
    assert c.state_slots == 4 and c.host_context_bytes == 8192 * 1024 * 1024
    small = EngineConfig(max_context=1000, kv_capacity=500, device_state_slots=0, host_context_mib=0)
    assert small.sequence_limit == 512 and small.state_slots == 1 and small.host_context_bytes == 0
