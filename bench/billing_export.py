"""Export of up to a million ledger rows: time and peak memory, which must stay flat as rows grow.

Ours: the export task's path (`billing.services.export_build`: keyset pages of 5,000
rows, each written out before the next is read). Peer in the same run: the naive
path, the whole range read into one list and then written (what a view that
answers with the CSV in one go does). Each export runs in a fresh child process,
so its peak resident memory (VmHWM) is its own; the table reports it above the
child's resident memory just before the export started.

    DATABASE_URL=postgres://... python bench/billing_export.py [--sizes 100000,300000,1000000]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "platform"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _memory_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def _seed(tenant_id: int, rows: int) -> None:
    """`rows` ledger rows one second apart from T0, written directly (not the subject here)."""
    from django.db import connection

    from billing.models import UsageRecord

    if connection.vendor != "postgresql":
        raise SystemExit("run this against PostgreSQL (DATABASE_URL)")
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO {UsageRecord._meta.db_table}
            (request_id, tenant_id, api_key_id, api_key_prefix, model, adapter, prompt_tokens,
             cached_tokens, completion_tokens, finish_reason, queue_ms, ttft_ms, total_ms,
             occurred_at, billing_period, currency, input_cost, cached_input_cost,
             output_cost, cost, recorded_at)
            SELECT 'bx-' || %s || '-' || g, %s, 1000 + g %% 7, 'atr_abcdefgh',
                   'bench-model', CASE WHEN g %% 3 = 0 THEN 'acme/support@1' ELSE '' END,
                   1000 + g %% 500, 200, 50 + g %% 300, 'stop', 5, 20, 500,
                   %s + g * interval '1 second', DATE '2026-01-01', 'USD', 0.000800,
                   0.000100, 0.000100 + (g %% 300) * 0.000002,
                   0.001000 + (g %% 300) * 0.000002, now()
            FROM generate_series(0, %s - 1) AS g""", [tenant_id, tenant_id, T0, rows])


def _child(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from billing import exports, services
    from billing.models import UsageRecord
    from tenants.access import SYSTEM
    from tenants.models import Tenant

    tenant = Tenant.objects.get(pk=args.tenant)
    start, end = T0, T0 + timedelta(seconds=args.rows)
    base = _memory_mb("VmRSS")
    started = time.perf_counter()
    if args.child == "ours":
        kind, fmt = {"csv": ("ledger", "csv"), "jsonl": ("ledger", "jsonl"),
                     "meter": ("meter_events", "jsonl")}[args.format]
        export = services.export_create(tenant=tenant, actor=SYSTEM, kind=kind, format=fmt,
                                        start=start, end=end)
        export = services.export_build(export_id=export.pk)
        rows, size = export.rows, export.size_bytes
        exports.export_storage().delete(export.file_name)
    else:
        everything = list(UsageRecord.objects.filter(
            tenant=tenant, occurred_at__gte=start, occurred_at__lt=end)
            .order_by("occurred_at", "id").values_list(*exports.LEDGER_COLUMNS))
        path = Path(args.scratch) / "peer.csv"
        with open(path, "w", newline="") as out:
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(["tenant", *exports.LEDGER_COLUMNS])
            writer.writerows([tenant.slug, *r] for r in everything)
        rows, size = len(everything), path.stat().st_size
        path.unlink()
    seconds = time.perf_counter() - started
    print(json.dumps({"rows": rows, "bytes": size, "seconds": round(seconds, 2),
                      "rows_per_s": round(rows / seconds),
                      "rss_before_mb": round(base, 1),
                      "peak_above_start_mb": round(_memory_mb("VmHWM") - base, 1)}))


def _run_child(tenant_id: int, who: str, rows: int, fmt: str, scratch: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", who, "--tenant", str(tenant_id),
                          "--rows", str(rows), "--format", fmt, "--scratch", scratch],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100000,300000,1000000")
    parser.add_argument("--child", choices=["ours", "peer"])
    parser.add_argument("--tenant", type=int)
    parser.add_argument("--rows", type=int)
    parser.add_argument("--format", default="csv")
    parser.add_argument("--scratch", default="/tmp")
    args = parser.parse_args()
    if args.child:
        return _child(args)

    import tempfile

    import django

    django.setup()
    from django.db import connection

    from bench.workload import write_result
    from billing.models import UsageRecord
    from tests.factories import tenant_factory

    sizes = [int(s) for s in args.sizes.split(",")]
    tenant = tenant_factory(slug=f"bench-export-{int(time.time())}")
    _seed(tenant.pk, max(sizes))
    connection.close()
    scratch = tempfile.mkdtemp(prefix="billing-export-bench-")
    runs = []
    try:
        for rows in sizes:
            for who, fmt in (("ours", "csv"), ("peer", "csv")):
                result = {"path": who, "format": fmt, **_run_child(tenant.pk, who, rows, fmt,
                                                                    scratch)}
                print(result, flush=True)
                runs.append(result)
        for fmt in ("jsonl", "meter"):
            result = {"path": "ours", "format": fmt, **_run_child(tenant.pk, "ours", max(sizes),
                                                                   fmt, scratch)}
            print(result, flush=True)
            runs.append(result)
    finally:
        UsageRecord.objects.filter(tenant=tenant).delete()
    print("->", write_result("billing_export", {"database": connection.vendor, "runs": runs}))


if __name__ == "__main__":
    main()
