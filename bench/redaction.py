"""Redaction throughput (MB/s) on realistic prompts, its cost per request on the hot path,
and its precision and recall on the labelled corpus.

Peers in the same run, on the same texts:
- no redaction: only serializing the text for the JSON column (the floor);
- a naive redactor: all the built-in patterns in one alternation, replaced in one
  ``re.sub`` pass, with no validation (no Luhn, mod-97 or address checks).

    python bench/redaction.py [--mb 4] [--requests 2000] [--db]

``--db`` also times writing request logs (bodies off and on) into the configured
database (DATABASE_URL, migrated), as the web process's writer thread does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

from bench.workload import write_result  # noqa: E402
from redaction import DETECTORS, redact, redact_json, tenant_detector  # noqa: E402

PROSE = [
    "Can you summarize the following report for the leadership team in five bullet points?",
    "The quarterly numbers show revenue up 12% while churn stayed flat at 2.1%.",
    "Please rewrite this paragraph so it sounds friendlier but keeps every fact.",
    "We migrated the billing service to the new cluster on Tuesday without downtime.",
    "Explain the difference between a process and a thread to a new engineer.",
    "The customer reported that exports fail when the file is larger than 2 GB.",
    "Translate the release notes into German and keep the product names in English.",
    "Our onboarding checklist has 14 steps; the slowest is waiting for laptop access.",
    "Draft a reply that apologizes for the delay and proposes a call next week.",
    "In 2023 the team shipped 48 releases, 6 of which needed a hotfix within a day.",
]
CODE = '''def retry(fn, attempts=3, delay=0.5):
    for i in range(attempts):
        try:
            return fn()
        except TimeoutError as exc:
            log.warning("attempt %d failed: %s", i + 1, exc)
            time.sleep(delay * 2 ** i)
    raise RuntimeError("gave up")
'''
JSON_DOC = json.dumps({"id": 4821, "status": "shipped", "items": [
    {"sku": "KB-204", "qty": 2, "price": 49.5}, {"sku": "MS-11", "qty": 1, "price": 19.99}],
    "created_at": "2024-05-01T12:00:00Z", "notes": "leave at the door"}, indent=2)
LOGS = ("2024-05-01T12:00:01Z INFO api request finished status=200 duration_ms=41\n"
        "2024-05-01T12:00:02Z WARN worker queue depth 118 above 100\n")
PII = ["contact jane.doe@example.com for access", "card 4111 1111 1111 1111 exp 12/27",
       "call +1 415-555-0132", "password=hunter22", "from 203.0.113.42",
       "key AKIAIOSFODNN7EXAMPLE", "IBAN DE89370400440532013000", "ssn 078-05-1120"]
TENANT_PATTERNS = [r"EMP-\d{6}", r"(?i)\bproj-[a-z0-9]{8}\b", r"TKT[:#]\s{0,3}[0-9a-f]{6,12}",
                   r"(?:AB|CD|EF)\d{4}[A-Z]", r"ACME-[A-Z0-9]+"]


def realistic_prompt(rng: random.Random, size: int) -> str:
    """Prose, code, JSON and log lines, with a secret or personal datum every ~2 kB."""
    parts, length = [], 0
    while length < size:
        roll = rng.random()
        if roll < 0.55:
            part = " ".join(rng.choice(PROSE) for _ in range(rng.randint(2, 5)))
        elif roll < 0.70:
            part = CODE
        elif roll < 0.82:
            part = JSON_DOC
        else:
            part = LOGS
        if rng.random() < len(part) / 2048:
            part += " " + rng.choice(PII)
        parts.append(part)
        length += len(part) + 2
    return "\n\n".join(parts)[:size]


def naive_redactor() -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{d.pattern.pattern})" for d in DETECTORS))


def throughput(texts: list[str], fn) -> float:
    """MB/s of ``fn`` over ``texts`` (best of three passes: the machine is shared)."""
    total = sum(len(t.encode()) for t in texts)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for text in texts:
            fn(text)
        best = min(best, time.perf_counter() - started)
    return round(total / best / 1e6, 2)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def per_request(rng: random.Random, n: int, extra) -> dict[str, float]:
    """Microseconds to redact one typical chat request's bodies (what the writer thread
    does when a tenant keeps bodies; with the GIL held, the event loop waits as long)."""
    times = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": realistic_prompt(rng, 1500)}]
        completion = realistic_prompt(rng, 800)
        started = time.perf_counter()
        redact_json(messages, extra)
        redact(completion, extra)
        times.append(time.perf_counter() - started)
    return {"p50_us": round(pct(times, 50) * 1e6, 1), "p99_us": round(pct(times, 99) * 1e6, 1),
            "mean_us": round(statistics.fmean(times) * 1e6, 1)}


def database_writes(rng: random.Random, n: int) -> dict[str, object]:
    import django

    django.setup()
    from django.db import connection

    from requestlogs.models import RequestLog
    from requestlogs.services import RequestLogEntry, log_policy_update, request_log_record
    from tenants.access import SYSTEM
    from tests.factories import tenant_factory

    out: dict[str, object] = {"database": connection.vendor}
    for bodies in (False, True):
        tenant = tenant_factory(f"bench-logs-{uuid.uuid4().hex[:8]}")
        log_policy_update(tenant=tenant, actor=SYSTEM, log_bodies=bodies)
        times = []
        for _ in range(n):
            entry = RequestLogEntry(
                request_id=uuid.uuid4().hex, tenant_id=tenant.pk, endpoint="chat",
                transport="http", model="atrium-demo", status=200, finish_reason="stop",
                prompt_tokens=400, completion_tokens=200,
                prompt=[{"role": "user", "content": realistic_prompt(rng, 1500)}],
                completion=realistic_prompt(rng, 800))
            started = time.perf_counter()
            request_log_record(entry=entry)
            times.append(time.perf_counter() - started)
        out["bodies_on" if bodies else "bodies_off"] = {
            "p50_ms": round(pct(times, 50) * 1e3, 3), "p99_ms": round(pct(times, 99) * 1e3, 3)}
        RequestLog.objects.filter(tenant=tenant).delete()
        tenant.delete()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=4.0, help="text per size, in MB")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--db", action="store_true", help="also time request-log writes")
    args = parser.parse_args()

    rng = random.Random(0)
    extra = tuple(tenant_detector(f"T{i}", p) for i, p in enumerate(TENANT_PATTERNS))
    naive = naive_redactor()
    sizes = {}
    for size in (1024, 8192, 65536):
        texts = [realistic_prompt(rng, size) for _ in range(max(1, int(args.mb * 1e6 / size)))]
        sizes[f"{size // 1024}KiB"] = {
            "no_redaction_json_dumps": throughput(texts, json.dumps),
            "naive_single_alternation": throughput(texts, lambda t: naive.sub("[X]", t)),
            "atrium_redact": throughput(texts, redact),
            "atrium_redact_with_5_tenant_patterns": throughput(texts, lambda t: redact(t, extra)),
        }
        print(size, sizes[f"{size // 1024}KiB"])
    result: dict[str, object] = {
        "throughput_mb_per_s": sizes,
        "per_request_redaction": {"builtin": per_request(rng, args.requests, ()),
                                  "with_5_tenant_patterns": per_request(rng, args.requests,
                                                                        extra)},
    }
    from tests.platform.redaction_corpus import NEGATIVES, POSITIVES, score

    s = score()
    result["corpus"] = {
        "positives": len(POSITIVES), "look_alikes": len(NEGATIVES), "labelled": s.labelled,
        "recall": {g: round(s.recall(g), 4) for g in s.labelled},
        "precision": round(s.precision, 4), "detections": s.detections,
        "false_positives": s.false_positives}
    if args.db:
        result["request_log_write"] = database_writes(rng, min(args.requests, 500))
    print(json.dumps(result, indent=2))
    print("->", write_result("redaction", result))


if __name__ == "__main__":
    main()
