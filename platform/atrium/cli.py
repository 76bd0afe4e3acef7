"""The `atrium` command: run the platform's processes and manage tenants and keys."""

from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from atrium.cli_support import (
    atrium_home,
    django_setup,
    new_key,
    refuse_busy_port,
    tenant_or_exit,
)
from atrium.up import cmd_up


def cmd_migrate(args: argparse.Namespace) -> None:
    django_setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=args.verbosity)


def cmd_create_tenant(args: argparse.Namespace) -> None:
    django_setup()
    from tenants.services import TenantError, tenant_create

    try:
        tenant = tenant_create(name=args.name, slug=args.slug)
    except TenantError as exc:
        sys.exit(f"atrium: {exc}")
    print(tenant.slug)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``3600s`` or ``2w``."""
    match = re.fullmatch(r"\s*(\d{1,6})\s*([smhdw])\s*", text)
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; write a positive number and a unit: "
            "30d, 12h, 90m, 3600s or 2w")
    return timedelta(seconds=int(match.group(1)) * _DURATION_UNITS[match.group(2)])


def parse_scopes(text: str) -> list[str]:
    return [scope.strip() for scope in text.split(",") if scope.strip()]


def cmd_create_key(args: argparse.Namespace) -> None:
    django_setup()
    print(new_key(tenant_or_exit(args.tenant), name=args.name, scopes=args.scopes,
                   expires_in=args.expires_in))


def cmd_set_limits(args: argparse.Namespace) -> None:
    """Overrides a tenant's plan limits (audited as the command line), as the console does."""
    django_setup()
    from core.errors import ApiError
    from tenants.access import Actor
    from tenants.services import tenant_quota_update

    changes = {field: getattr(args, field) for field in LIMIT_FIELDS
               if getattr(args, field) is not None}
    if not changes:
        sys.exit("atrium: name at least one limit, e.g. --max-concurrent-requests 500")
    try:
        tenant_quota_update(tenant=tenant_or_exit(args.tenant), actor=Actor(), changes=changes)
    except ApiError as exc:
        sys.exit(f"atrium: {exc.message}")
    print(", ".join(f"{field} {value}" for field, value in changes.items()))


LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")


def _read_password(from_stdin: bool) -> str:
    import getpass

    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    password = getpass.getpass("Password: ")
    if password != getpass.getpass("Password (again): "):
        sys.exit("atrium: the passwords differ")
    return password


def cmd_create_user(args: argparse.Namespace) -> None:
    """A console account: an operator, or a member of a tenant with a role."""
    django_setup()
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError
    from django.db import transaction

    from core.errors import ApiError
    from tenants.services import membership_create, user_create

    if not args.operator and not args.tenant:
        sys.exit("atrium: name a tenant (--tenant SLUG) or make an operator (--operator)")
    tenant = tenant_or_exit(args.tenant) if args.tenant else None
    password = _read_password(args.password_stdin)
    try:
        validate_password(password)
    except ValidationError as exc:
        sys.exit("atrium: " + " ".join(exc.messages))
    try:
        with transaction.atomic():
            user = user_create(email=args.email, password=password, is_staff=args.operator)
            if tenant is not None:
                membership_create(tenant=tenant, user=user, role=args.role)
    except ApiError as exc:
        sys.exit(f"atrium: {exc.message}")
    where = f"{args.role} of '{tenant.slug}'" if tenant else "operator"
    print(f"created {user.email} ({where}{' and operator' if tenant and args.operator else ''})"
          "; sign in at /console/")


def cmd_revoke_key(args: argparse.Namespace) -> None:
    django_setup()
    from tenants.models import ApiKey
    from tenants.services import api_key_revoke

    tenant = tenant_or_exit(args.tenant)
    key = ApiKey.objects.fortenant_or_exit(tenant).filter(prefix=args.prefix).first()
    if not key:
        sys.exit(f"atrium: tenant {args.tenant!r} has no key with prefix {args.prefix!r}")
    api_key_revoke(tenant=tenant, key_id=key.pk)
    print(f"revoked {key.prefix}")


def cmd_register_adapter(args: argparse.Namespace) -> None:
    path, name = _model()
    from adapters.services import AdapterRejected, adapter_register

    tenant = tenant_or_exit(args.tenant)
    try:
        adapter = adapter_register(tenant=tenant, name=args.name, source_dir=Path(args.path),
                                   base_model=name, base_model_dir=path, public=args.public)
    except (AdapterRejected, OSError) as exc:
        sys.exit(f"atrium: adapter refused: {exc}")
    print(f"{name}:{adapter.name}@{adapter.version} ({adapter.content_hash[:12]}, "
          f"{adapter.visibility})")


def cmd_build_demo_model(args: argparse.Namespace) -> None:
    from engine.demo_model import ensure_demo_model

    print(ensure_demo_model(atrium_home()))


def cmd_web(args: argparse.Namespace) -> None:
    import uvicorn

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")
    refuse_busy_port(args.host, args.port, hint="atrium web --port {port}")
    from atrium.asgi import application
    from atrium.server import DrainingServer, server_options

    # NOTE: what the process holds once loaded (Django, the apps, the tokenizer) lives as
    # long as it does: frozen, a full collection no longer walks it. Measured with 1,000
    # streams open: full collections held the event loop 130-270 ms each, the web tier's
    # slowest answers.
    from engine import tracing

    tracing.configure_from_env("atrium-web")  # off unless the OTEL_* variables say so
    if args.metrics_port:
        from atrium.metrics import FleetCollector
        from core.metrics import serve

        serve(args.metrics_port, host=args.metrics_host, what="web process",
              extra=[FleetCollector()])
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)
    server = DrainingServer(uvicorn.Config(
        application, host=args.host, port=args.port,
        log_level="info", log_config=None,  # Django's LOGGING: JSON, redacted
        **server_options()))
    server.run()
    if not server.started:
        sys.exit("atrium web: the server did not start")


def _model(name: str | None) -> tuple[Path, str]:
    """The served model an engine serves: the one named, or the only one."""
    django_setup()
    from core.served_models import model_paths

    paths = model_paths()
    if name is None and len(paths) > 1:
        sys.exit(f"atrium engine: several models are served ({', '.join(paths)}); name the "
                 "one this engine serves with --model-name")
    name = name or next(iter(paths))
    if name not in paths:
        sys.exit(f"atrium engine: {name!r} is not a served model ({', '.join(paths)}); "
                 "give --model-dir to serve a folder under that name")
    return paths[name], name


def cmd_engine(args: argparse.Namespace) -> None:
    from engine.options import engine_factory_from_args
    from engine.worker import WorkerConfig, run_worker

    path, name = (Path(args.model_dir), args.model_name or Path(args.model_dir).name) \
        if args.model_dir else _model(args.model_name)
    django_setup()
    from django.conf import settings

    # The store the platform registers adapters into, and its Redis (settings.py).
    args.adapter_store = args.adapter_store or str(settings.ATRIUM_ADAPTER_STORE)
    # A generative model the platform answers embeddings from: its engine computes them.
    args.embeddings = args.embeddings or name in settings.ATRIUM_EMBEDDING_MODELS
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a clean stop: requests end, it deregisters
        signal.signal(sig, lambda *_: stop.set())
    run_worker(redis_url=settings.REDIS_URL, model_dir=path, model_name=name,
               engine_id=args.engine_id, engine_factory=engine_factory_from_args(args),
               config=WorkerConfig(drain_s=args.drain_seconds),
               metrics_port=args.metrics_port, metrics_host=args.metrics_host, stop=stop)


def cmd_worker(args: argparse.Namespace) -> None:
    if args.metrics_port and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # NOTE: tasks run in the pool's child processes; only files they all write to
        # reach the endpoint (prometheus-client reads the variable when it is imported).
        sys.exit("atrium worker: --metrics-port needs PROMETHEUS_MULTIPROC_DIR, an empty "
                 "directory the worker's processes share (docs/observability.md)")
    django_setup()
    from atrium.celery import app

    if args.metrics_port:
        from core.metrics import serve

        serve(args.metrics_port, host=args.metrics_host, what="Celery worker")

    queues, pool, concurrency, nice = _worker_shape(args)
    if nice:
        os.nice(nice)  # this worker's processes yield the CPU to web and engines
    argv = ["worker", "--loglevel=INFO", f"--concurrency={concurrency}", f"--pool={pool}",
            f"--queues={queues}",
            # Workers serving different queues on one host need names of their own.
            f"--hostname={args.lane or queues.replace(',', '-')}@%h"]
    if not args.no_beat:
        beat_db = atrium_home() / "celerybeat-schedule"
        argv += ["--beat", f"--schedule={beat_db}"]
    app.worker_main(argv)


def _worker_shape(args: argparse.Namespace) -> tuple[str, str, int, int]:
    """Queues, pool, concurrency and niceness: the lane's (atrium/lanes.py), or every
    lane's queues in one prefork pool, with the flags given over either."""
    from atrium.lanes import ALL_QUEUES, LANES

    if args.lane:
        lane = LANES[args.lane]
        queues, pool, concurrency, nice = (",".join(lane.queues), lane.pool,
                                           lane.concurrency, lane.nice)
    else:
        queues, pool, concurrency, nice = ",".join(ALL_QUEUES), "prefork", 2, 0
        if not args.queues:
            print("atrium worker: every lane's queues in one pool, where a tenant's slow work "
                  "can hold up usage ingest; run one worker per lane (--lane, "
                  "docs/deploy.md#lanes)", file=sys.stderr)
    return (args.queues or queues, args.pool or pool, args.concurrency or concurrency,
            nice if args.nice is None else args.nice)


def cmd_beat(args: argparse.Namespace) -> None:
    """The periodic tasks' scheduler alone, for a deployment that runs workers with
    --no-beat (one beat per deployment: two would run every task twice)."""
    django_setup()
    from atrium.celery import app

    app.start(["beat", "--loglevel=INFO",
               f"--schedule={atrium_home() / 'celerybeat-schedule'}"])


def build_parser() -> argparse.ArgumentParser:
    from engine.options import add_engine_arguments, add_metrics_arguments

    parser = argparse.ArgumentParser(prog="atrium", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    port = int(os.environ.get("ATRIUM_PORT") or 8000)
    up = sub.add_parser("up", help="web + engine + Celery worker and beat, on embedded defaults")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=port, help="default: ATRIUM_PORT or 8000")
    up.add_argument("--new-key", action="store_true",
                    help="mint another key for the demo tenant and show it")
    up.add_argument("--metrics-port", type=int, default=None,
                    help="the first of three loopback ports for the web, engine and worker "
                         "metrics endpoints (default: --port + 1)")
    up.set_defaults(func=cmd_up)

    web = sub.add_parser("web", help="the ASGI web server (API, websockets, console)")
    web.add_argument("--host", default="127.0.0.1")
    web.add_argument("--port", type=int, default=port, help="default: ATRIUM_PORT or 8000")
    add_metrics_arguments(web, "ATRIUM_WEB_METRICS_PORT")
    web.set_defaults(func=cmd_web)

    eng = sub.add_parser("engine", help="one engine worker")
    eng.add_argument("--model-dir", help="Hugging Face layout directory (default: ATRIUM_MODEL)")
    eng.add_argument("--model-name", help="the served model this engine serves (default: the "
                     "only one; with --model-dir: the folder's name)")
    eng.add_argument("--engine-id")
    add_engine_arguments(eng)
    eng.set_defaults(func=cmd_engine)

    from atrium.lanes import LANES

    worker = sub.add_parser("worker", help="Celery worker with beat")
    worker.add_argument("--lane", choices=sorted(LANES),
                        help="serve one lane of background work with its own pool and "
                        "concurrency (docs/deploy.md#lanes): " + "; ".join(
                            f"{name}: {lane.what}" for name, lane in LANES.items())
                        + ". Without it: every lane's queues in one pool")
    worker.add_argument("--concurrency", type=int, help="processes or threads (the lane's, "
                        "or 2)")
    worker.add_argument("--pool", choices=("prefork", "threads", "solo"),
                        help="Celery's pool (the lane's, or prefork)")
    worker.add_argument("--no-beat", action="store_true")
    worker.add_argument("--nice", type=int, help="lower this worker's CPU priority by N "
                        "(the lane's on one host: jobs and batches yield to web and engines)")
    worker.add_argument("--queues", help="Celery queues to serve, over the lane's: celery, "
                        "alerts, webhooks, exports, adapters, batches")
    add_metrics_arguments(worker, "ATRIUM_WORKER_METRICS_PORT")
    worker.set_defaults(func=cmd_worker)

    beat = sub.add_parser("beat", help="Celery beat alone (for workers run with --no-beat)")
    beat.set_defaults(func=cmd_beat)

    mig = sub.add_parser("migrate", help="create or update the database tables")
    mig.add_argument("--verbosity", type=int, default=1)
    mig.set_defaults(func=cmd_migrate)

    tenant = sub.add_parser("create-tenant", help="create a tenant; prints its slug")
    tenant.add_argument("name")
    tenant.add_argument("--slug")
    tenant.set_defaults(func=cmd_create_tenant)

    key = sub.add_parser("create-key", help="create an API key; prints it once")
    key.add_argument("tenant", help="tenant slug")
    key.add_argument("--name", default="cli")
    key.add_argument("--scopes", type=parse_scopes, default=["inference"],
                     help="comma-separated, of inference, adapters, usage, billing, admin "
                          "(default: inference)")
    key.add_argument("--expires-in", type=parse_duration, metavar="DURATION",
                     help="e.g. 30d, 12h, 90m, 2w (default: no expiry)")
    key.set_defaults(func=cmd_create_key)

    limits = sub.add_parser("set-limits", help="override a tenant's plan limits")
    limits.add_argument("tenant", help="tenant slug")
    for field in LIMIT_FIELDS:
        limits.add_argument(f"--{field.replace('_', '-')}", type=int, metavar="N")
    limits.set_defaults(func=cmd_set_limits)

    user = sub.add_parser("create-user", help="create a console account (password prompted)")
    user.add_argument("email")
    user.add_argument("--tenant", help="make them a member of this tenant (slug)")
    user.add_argument("--role", default="owner",
                      help="their role in --tenant: owner (default), admin, developer, "
                           "billing or viewer")
    user.add_argument("--operator", action="store_true",
                      help="an operator (Django staff): sees every tenant")
    user.add_argument("--password-stdin", action="store_true",
                      help="read the password from standard input instead of a prompt")
    user.set_defaults(func=cmd_create_user)

    revoke = sub.add_parser("revoke-key", help="revoke an API key by its visible prefix")
    revoke.add_argument("tenant", help="tenant slug")
    revoke.add_argument("prefix")
    revoke.set_defaults(func=cmd_revoke_key)

    reg = sub.add_parser("register-adapter",
                         help="check a PEFT LoRA folder and make it callable by a tenant")
    reg.add_argument("tenant", help="tenant slug (the owner)")
    reg.add_argument("name", help="the adapter's name; a new version if it exists")
    reg.add_argument("path", help="folder with adapter_config.json + adapter_model.safetensors")
    reg.add_argument("--public", action="store_true", help="callable by every tenant")
    reg.set_defaults(func=cmd_register_adapter)

    demo = sub.add_parser("build-demo-model", help="build (once) the demo model; prints its path")
    demo.set_defaults(func=cmd_build_demo_model)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ImproperlyConfigured as exc:  # settings or the Celery broker: one clear line
        sys.exit(f"atrium: {exc}")


if __name__ == "__main__":
    main()
