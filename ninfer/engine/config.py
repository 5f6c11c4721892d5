"""Engine options: their names, defaults and valid ranges as the Engine enforces them.

``ninfer serve``'s flags, their help and the defaults a user sees are ``ninfer/options.py``'s (spec:
"Server options"); an Engine built without the CLI (tests, ``ninfer bench engine``) takes these.
"""

from __future__ import annotations

import attrs

MAX_LANES = 8
# Spec default for --host-context-mib: 8192 MiB plus eight model StateImages. The StateImage size
# depends on the model, so the Engine core adds the eight images (none for a dense model).
DEFAULT_HOST_CONTEXT_MIB = 8192
DEFAULT_HOST_STATE_IMAGES = 8


def _positive(instance, attribute, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _non_negative(instance, attribute, value) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be non-negative, got {value}")


def _lanes(instance, attribute, value) -> None:
    if not 1 <= value <= MAX_LANES:
        raise ValueError(f"max_concurrency must be in 1..{MAX_LANES}, got {value}")


def _page_size(instance, attribute, value) -> None:
    if value <= 0 or value & (value - 1):
        raise ValueError(f"page_size must be a positive power of two, got {value}")


def _top_k(instance, attribute, value) -> None:
    if value is not None and not 0 <= value <= 20:
        raise ValueError(f"top_k must be in 0..20 (0 selects the top-20 cap), got {value}")


def _unit(instance, attribute, value) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


def _temperature(instance, attribute, value) -> None:
    if value is not None and not 0.0 <= value <= 2.0:
        raise ValueError(f"temperature must be in [0, 2], got {value}")


def _seed(instance, attribute, value) -> None:
    if value is not None and not -(2**63) <= value < 2**63:
        raise ValueError(f"seed must be a signed 64-bit integer, got {value}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Process-wide Engine options (spec option table). ``None`` means "use the default rule"."""

    max_concurrency: int = attrs.field(default=1, validator=_lanes)
    max_pending_requests: int = attrs.field(default=16, validator=_non_negative)
    pending_timeout_ms: int = attrs.field(default=30000, validator=_positive)
    prefill_chunk: int = attrs.field(default=1024, validator=_positive)
    max_context: int = attrs.field(default=8192, validator=_positive)
    # Tokens of the shared Main KV pool; None follows max_context. "auto" is resolved by the CUDA
    # backend before the Engine sees the config.
    kv_capacity: int | None = attrs.field(default=None, validator=_positive)
    page_size: int = attrs.field(default=16, validator=_page_size)
    prefix_reuse: bool = True
    # Shared Host backing for pause snapshots; None selects the spec default, 0 disables it.
    host_context_mib: int | None = attrs.field(default=None, validator=_non_negative)
    # Extra Device StateImage slots beyond max_concurrency; None selects max_concurrency.
    device_state_slots: int | None = attrs.field(default=None, validator=_non_negative)
    context_cost_presets: str | None = None  # path of a JSON preset file
    # Process-level sampler overrides (--temperature ... --seed); None leaves the preset value.
    temperature: float | None = attrs.field(default=None, validator=_temperature)
    top_p: float | None = attrs.field(default=None, validator=_unit)
    top_k: int | None = attrs.field(default=None, validator=_top_k)
    min_p: float | None = attrs.field(default=None, validator=_unit)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = attrs.field(default=None, validator=_seed)
    greedy: bool = False

    @property
    def kv_capacity_tokens(self) -> int:
        return self.max_context if self.kv_capacity is None else self.kv_capacity

    @property
    def kv_pages(self) -> int:
        """Pages of the Main KV pool (capacity rounded up to whole pages)."""
        return -(-self.kv_capacity_tokens // self.page_size)

    @property
    def state_slots(self) -> int:
        extra = self.max_concurrency if self.device_state_slots is None else self.device_state_slots
        return self.max_concurrency + extra

    @property
    def host_context_bytes(self) -> int:
        """The Host budget's bytes before StateImages: ``host_state_images`` of them come on top."""
        mib = DEFAULT_HOST_CONTEXT_MIB if self.host_context_mib is None else self.host_context_mib
        return mib * 1024 * 1024

    @property
    def host_state_images(self) -> int:
        """StateImages the Host budget holds beyond ``host_context_bytes``: the default's eight."""
        return DEFAULT_HOST_STATE_IMAGES if self.host_context_mib is None else 0

    @property
    def lifetime_capacity(self) -> int:
        """Requests alive at once, from reservation to release (spec: Execution behavior)."""
        return self.max_concurrency + self.max_pending_requests

    @property
    def sequence_limit(self) -> int:
        """Longest sequence one request may hold: the context ceiling, bounded by the KV pool."""
        return min(self.max_context, self.kv_pages * self.page_size)
