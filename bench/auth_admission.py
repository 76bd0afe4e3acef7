"""The hot path's own cost: authenticating the API key and admitting the request's quotas.

Per request, as the inference views do it: ``authenticate`` (key cache in Redis; the
database only on a miss) + ``precheck`` (the admission script in check-only mode, before
the prompt is tokenized, so a refused caller costs no parsing) + ``admit`` (one Lua
script over tenant and key limits, after the spend-cap read) + ``settle`` when the
request ends. Measured in one asyncio process
against Redis on loopback:
- latency added per request, sequentially (median, p99), with the cache warm;
- the peer in the same run: authentication without the key cache (a database lookup
  per request, as if every request missed), plus the same admission;
- sustained admitted requests/s with 32 requests in flight.

    DATABASE_URL=postgres://... REDIS_URL=redis://127.0.0.1:6379/12 \\
        .venv/bin/python bench/auth_admission.py [--requests 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "platform"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("ATRIUM_HOME", tempfile.mkdtemp(prefix="atrium-bench-"))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def stats_us(samples: list[float]) -> dict[str, float]:
    return {"median_us": round(statistics.median(samples) * 1e6, 1),
            "p99_us": round(pct(samples, 99) * 1e6, 1),
            "mean_us": round(statistics.fmean(samples) * 1e6, 1)}


async def main_async(args: argparse.Namespace) -> dict:
    from asgiref.sync import sync_to_async

    from core.redis import async_client
    from inference import admission
    from inference.auth import authenticate
    from tenants import keys
    from tenants.access import SYSTEM
    from tenants.selectors import key_state_by_digest
    from tenants.services import api_key_create, plan_create, tenant_create

    @sync_to_async
    def make_key() -> str:
        suffix = uuid.uuid4().hex[:8]
        plan = plan_create(actor=SYSTEM, slug=f"bench-{suffix}", name="Bench", priority=5,
                           requests_per_minute=10**9, tokens_per_minute=2 * 10**9,
                           max_concurrent_requests=10**6)
        tenant = tenant_create(name="Bench", slug=f"bench-{suffix}", plan=plan)
        return api_key_create(tenant=tenant, name="bench")[1]

    plaintext = await make_key()
    header = f"Bearer {plaintext}"
    client = async_client()
    lookup = sync_to_async(key_state_by_digest)

    async def admitted(principal) -> None:
        await admission.precheck(client, principal=principal)
        granted = await admission.admit(client, principal=principal,
                                        request_id=uuid.uuid4().hex, prompt_tokens=100,
                                        max_tokens=100, lease_s=60, spend_checked=True)
        await admission.settle(client, granted, used_tokens=150)

    async def cached_path() -> None:
        await admitted(await authenticate(header))

    async def uncached_path() -> None:
        await admitted(await lookup(digest=keys.digest(plaintext)))

    async def auth_only() -> None:
        await authenticate(header)

    async def timed(fn, n: int) -> list[float]:
        for _ in range(50):  # warm: connections, script cache, key cache
            await fn()
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            await fn()
            samples.append(time.perf_counter() - start)
        return samples

    result = {"requests": args.requests,
              "auth_only_cached": stats_us(await timed(auth_only, args.requests)),
              "auth_and_admission_cached": stats_us(await timed(cached_path, args.requests)),
              "peer_auth_db_per_request_and_admission": stats_us(
                  await timed(uncached_path, max(500, args.requests // 5)))}

    async def worker(deadline: float, counter: list[int]) -> None:
        while time.perf_counter() < deadline:
            await cached_path()
            counter[0] += 1

    counter = [0]
    start = time.perf_counter()
    deadline = start + args.seconds
    await asyncio.gather(*(worker(deadline, counter) for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    result["sustained"] = {"concurrency": args.concurrency, "seconds": round(elapsed, 2),
                           "admitted_per_s": round(counter[0] / elapsed, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", interactive=False, verbosity=0)
    from django.conf import settings

    from bench.workload import write_result

    result = asyncio.run(main_async(args))
    result["database"] = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    result["redis"] = settings.REDIS_URL.split("@")[-1]
    path = write_result("auth_admission", result)
    print(result)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
