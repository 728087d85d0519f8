"""An open-loop load generator for an OpenAI-style ``/v1/completions`` endpoint (the serving owner's process,
``python -m libra.serving``, or any server that streams completions).

Arrivals are Poisson at ``rate`` requests per second for ``duration_s`` seconds (exponential gaps drawn from
``seed``): each request starts at its arrival time whether or not earlier ones finished (open loop, so an
overloaded server shows up as growing latency, not as a lower offered rate). Each request streams
(``stream: true``, ``ignore_eos: true``: fixed lengths) and is timed on the client: TTFT (send to the first
token), TPOT (``(last token - first token) / (tokens - 1)``) and latency. :func:`run_load` (async) and
:func:`serving_load` (sync) return a :class:`LoadReport`: every request, p50/p99 of each figure, and how many
requests missed a TPOT target. HTTP client: httpx (installed with the ``test`` extra).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from libra.serving.window import percentile  # nearest rank, as the server's /load

__all__ = ["LoadReport", "RequestTiming", "percentile", "run_load", "serving_load"]


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request: when it was sent (seconds from the run's start), its client-side timings (None when it
    failed or got fewer than two tokens for TPOT), its token count and its error (``""`` when it succeeded)."""

    sent_s: float
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None
    tokens: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The run: offered ``rate`` and ``duration_s``, every request, and the summary figures."""

    rate: float
    duration_s: float
    requests: list[RequestTiming] = field(default_factory=list)
    tpot_target_s: float | None = None

    def _q(self, attr: str, q: float) -> float | None:
        return percentile([v for r in self.requests if (v := getattr(r, attr)) is not None], q)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.requests if r.error)

    @property
    def tpot_violations(self) -> int:
        """Requests whose TPOT exceeded the target (0 without a target)."""
        t = self.tpot_target_s
        return 0 if t is None else sum(1 for r in self.requests if r.tpot_s is not None and r.tpot_s > t)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rate": self.rate, "duration_s": self.duration_s, "sent": len(self.requests),
                               "failed": self.failed, "tpot_target_s": self.tpot_target_s,
                               "tpot_violations": self.tpot_violations}
        for attr in ("ttft_s", "tpot_s", "latency_s"):
            out[f"p50_{attr}"], out[f"p99_{attr}"] = self._q(attr, 0.5), self._q(attr, 0.99)
        return out


async def _one(client: Any, url: str, body: dict[str, Any], t0: float) -> RequestTiming:
    sent = time.perf_counter()
    first = last = None
    n = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return RequestTiming(sent - t0, None, None, None, 0, f"http {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestTiming(sent - t0, None, None, None, n, str(chunk["error"].get("message")))
                if chunk.get("usage"):  # the last chunk: the count of tokens, whatever the text pieces were
                    n = int(chunk["usage"]["completion_tokens"])
                elif chunk["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
    except Exception as exc:  # a failed request is a result, not the end of the run
        return RequestTiming(sent - t0, None, None, None, n, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    ttft = None if first is None else first - sent
    tpot = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
    return RequestTiming(sent - t0, ttft, tpot, end - sent, n)


async def run_load(url: str, rate: float, duration_s: float, *, prompt: str | list[int] = "Hello there",
                   max_tokens: int = 32, tpot_target_s: float | None = None, seed: int = 0,
                   timeout_s: float = 60.0, temperature: float = 1.0) -> LoadReport:
    """Offer Poisson load at ``rate`` req/s for ``duration_s`` against ``url`` (the server's base,
    ``http://HOST:PORT``) and wait for every request; see the module docstring."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"rate and duration_s must be > 0, got {rate!r}, {duration_s!r}")
    try:
        import httpx
    except ImportError:
        raise ImportError("libra.bench.serving_load needs httpx: pip install 'libra[test]'") from None
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                    "temperature": temperature, "seed": seed * 1_000_003 + i}
            tasks.append(asyncio.create_task(_one(client, url, body, t0)))
        done = list(await asyncio.gather(*tasks))
    return LoadReport(rate, duration_s, done, tpot_target_s)


def serving_load(url: str, rate: float, duration_s: float, **kwargs: Any) -> LoadReport:
    """:func:`run_load` on a fresh event loop (for callers without one)."""
    return asyncio.run(run_load(url, rate, duration_s, **kwargs))
