"""Client-side rate limit of the requests one process sends to kube-apiserver.

client-go's token bucket (``flowcontrol.NewTokenBucketRateLimiter(qps, burst)``, behind
kube-scheduler's ``--kube-api-qps``/``--kube-api-burst``): ``burst`` tokens to start, refilled at
``qps`` per second up to ``burst``; each request takes one and waits until it is due. It applies to
every request, lists and the start of each watch included, never to the events a watch streams.

One ``TokenBucket`` per process, attached to the one ``Configuration`` every client is made from
(``attach_rate_limiter``): ``new_api_client`` then returns a ``RateLimitedApiClient`` and
``JsonSender`` takes its tokens from the same bucket, so all threads together stay within it. A
``Configuration`` without one (qps 0) gets the plain client: nothing added to a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client import rest

__all__ = ["RateLimitedApiClient", "TokenBucket", "attach_rate_limiter", "rate_limiter_of"]

log = logging.getLogger(__name__)

LONG_WAIT_SECONDS = 1.0  # a wait this long is logged (debug), as client-go logs one
_ATTRIBUTE = "fractional_rate_limiter"  # where attach_rate_limiter keeps it on a Configuration


class TokenBucket:
    """``burst`` tokens to start, ``qps`` more per second, never more than ``burst`` held.

    Thread-safe and fair: a caller takes its token under the lock, the count going below zero for
    tokens already promised to callers still waiting, and sleeps outside the lock until its own token
    is due. Callers are served in the order they came, each sleeps once (no polling), and a caller's
    wait is at most (callers waiting ahead of it + 1) / qps. ``observe`` gets every request's wait in
    seconds (0 when a token was there); ``clock`` and ``sleep`` are for tests."""

    def __init__(
        self,
        *,
        qps: float,
        burst: int,
        observe: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not qps > 0:
            raise ValueError(f"qps {qps} is not a positive number (0: use no bucket at all)")
        if burst < 1:
            raise ValueError(f"burst {burst} is less than 1")
        self.qps = qps
        self.burst = burst
        self._observe = observe
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)  # below zero: promised to callers still waiting
        self._refilled_at = clock()

    def reserve(self) -> float:
        """Take a token; the seconds until it is due (0: now). The caller must wait that long."""
        with self._lock:
            now = self._clock()
            if now > self._refilled_at:
                self._tokens = min(float(self.burst), self._tokens + (now - self._refilled_at) * self.qps)
                self._refilled_at = now
            self._tokens -= 1.0
            missing = -self._tokens
        return missing / self.qps if missing > 0 else 0.0

    def wait(self) -> float:
        """Take a token, sleeping until it is due; the seconds waited."""
        delay = self.reserve()
        if delay > 0:
            if delay >= LONG_WAIT_SECONDS:
                log.debug(
                    "request waits for the client-side rate limit", extra={"wait_seconds": round(delay, 3)}
                )
            self._sleep(delay)
        if self._observe is not None:
            self._observe(delay)
        return delay

    def __deepcopy__(self, memo: dict[int, Any]) -> TokenBucket:
        # A copied Configuration (the client copies its default one) shares the process's bucket,
        # as a copied rest.Config shares client-go's RateLimiter; a lock cannot be copied anyway.
        return self


def attach_rate_limiter(configuration: client.Configuration, limiter: TokenBucket | None) -> None:
    """Every client made from ``configuration`` from now on takes its tokens from ``limiter``
    (None: no limit)."""
    setattr(configuration, _ATTRIBUTE, limiter)


def rate_limiter_of(configuration: client.Configuration) -> TokenBucket | None:
    limiter = getattr(configuration, _ATTRIBUTE, None)
    return limiter if isinstance(limiter, TokenBucket) else None


class RateLimitedApiClient(client.ApiClient):
    """An ``ApiClient`` whose every request takes a token first. Every call of the client goes
    through ``call_api`` (typed API methods, their ``_preload_content=False`` form, the first request
    of a ``watch.Watch`` stream, ``get_json``), so this is the one place to wait."""

    def __init__(self, configuration: client.Configuration, limiter: TokenBucket) -> None:
        super().__init__(configuration)
        self.rate_limiter = limiter

    def call_api(self, *args: Any, **kwargs: Any) -> rest.RESTResponse:
        self.rate_limiter.wait()
        response: rest.RESTResponse = super().call_api(*args, **kwargs)
        return response
