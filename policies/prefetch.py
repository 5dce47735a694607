"""Built-in prefetch policies: how long a request waits for blocks coming up from the backends
(SGLang's prefetch stop policies).

=================  ============================================================================
``best_effort``    take what has arrived when the engine is ready; stop the rest
``wait_complete``  wait until every block of the prefetch has arrived (or failed)
``timeout``        wait at most ``min(max_s, base_s + per_1k_tokens_s * tokens / 1000)``
=================  ============================================================================
"""

from __future__ import annotations

from pydantic import Field, model_validator

from kvtier.policy_api import PolicyOptions, PrefetchPolicy


class BestEffort(PrefetchPolicy):
    """Never waits: ``wait()`` returns the blocks already in host memory."""

    def wait_seconds(self, num_tokens: int) -> float | None:
        return 0.0


class WaitComplete(PrefetchPolicy):
    """Waits for the whole prefetch (bounded by the backends' timeouts)."""

    def wait_seconds(self, num_tokens: int) -> float | None:
        return None


class Timeout(PrefetchPolicy):
    """Waits a time that grows with the prefetch size, capped: a long prompt may wait longer, but never
    more than ``max_s``."""

    class Options(PolicyOptions):
        base_s: float = Field(1.0, ge=0, description="fixed part of the wait, seconds")
        per_1k_tokens_s: float = Field(0.25, ge=0, description="extra seconds per 1000 prefetched tokens")
        max_s: float = Field(3.0, ge=0, description="upper bound of the wait, seconds")

        @model_validator(mode="after")
        def _order(self) -> Timeout.Options:
            if self.max_s < self.base_s:
                raise ValueError(f"max_s ({self.max_s}) must be >= base_s ({self.base_s})")
            return self

    options: Options

    def wait_seconds(self, num_tokens: int) -> float | None:
        o = self.options
        return min(o.max_s, o.base_s + o.per_1k_tokens_s * num_tokens / 1000)


__all__ = ["BestEffort", "Timeout", "WaitComplete"]
