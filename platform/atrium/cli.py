"""The `atrium` command: run the platform's processes and manage tenants and keys."""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured


def _django() -> None:
    _home()  # the SQLite file and the adapter store live there by default
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")
    import django

    django.setup()


def _home() -> Path:
    home = Path(os.environ.get("ATRIUM_HOME", Path.home() / ".atrium")).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def cmd_migrate(args: argparse.Namespace) -> None:
    _django()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=args.verbosity)


def cmd_create_tenant(args: argparse.Namespace) -> None:
    _django()
    from tenants.services import TenantError, tenant_create

    try:
        tenant = tenant_create(name=args.name, slug=args.slug)
    except TenantError as exc:
        sys.exit(f"atrium: {exc}")
    print(tenant.slug)


# What `atrium up` gives its one key: what a solo developer does in the first hour (call
# models, upload adapters, read usage, export the bill), not tenant administration.
DEMO_KEY_NAME = "demo key (atrium up)"
DEMO_KEY_SCOPES = ("inference", "adapters", "usage", "billing")
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


def _tenant(slug: str):
    from tenants.models import Tenant

    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        sys.exit(f"atrium: no tenant {slug!r}; create it with `atrium create-tenant`")
    return tenant


def _new_key(tenant, *, name: str, scopes, expires_in: timedelta | None) -> str:
    from django.utils import timezone

    from atrium.errors import ApiError
    from tenants.services import api_key_create

    expires_at = timezone.now() + expires_in if expires_in else None
    try:
        key, plaintext = api_key_create(tenant=tenant, name=name, scopes=scopes,
                                        expires_at=expires_at)
    except ApiError as exc:
        sys.exit(f"atrium: {exc.message}")
    until = f"until {key.expires_at:%Y-%m-%d %H:%M} UTC" if key.expires_at else "no expiry"
    print(f"created key {key.pk} ({key.prefix}…, '{key.name}') for tenant '{tenant.slug}': "
          f"scopes {', '.join(key.scopes)}; {until}", file=sys.stderr)
    return plaintext


def cmd_create_key(args: argparse.Namespace) -> None:
    _django()
    print(_new_key(_tenant(args.tenant), name=args.name, scopes=args.scopes,
                   expires_in=args.expires_in))


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
    _django()
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError
    from django.db import transaction

    from atrium.errors import ApiError
    from tenants.services import membership_create, user_create

    if not args.operator and not args.tenant:
        sys.exit("atrium: name a tenant (--tenant SLUG) or make an operator (--operator)")
    tenant = _tenant(args.tenant) if args.tenant else None
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
    _django()
    from tenants.models import ApiKey
    from tenants.services import api_key_revoke

    tenant = _tenant(args.tenant)
    key = ApiKey.objects.for_tenant(tenant).filter(prefix=args.prefix).first()
    if not key:
        sys.exit(f"atrium: tenant {args.tenant!r} has no key with prefix {args.prefix!r}")
    api_key_revoke(tenant=tenant, key_id=key.pk)
    print(f"revoked {key.prefix}")


def cmd_register_adapter(args: argparse.Namespace) -> None:
    path, name = _model()
    from adapters.services import AdapterRejected, adapter_register

    tenant = _tenant(args.tenant)
    try:
        adapter = adapter_register(tenant=tenant, name=args.name, source_dir=Path(args.path),
                                   base_model=name, base_model_dir=path, public=args.public)
    except (AdapterRejected, OSError) as exc:
        sys.exit(f"atrium: adapter refused: {exc}")
    print(f"{name}:{adapter.name}@{adapter.version} ({adapter.content_hash[:12]}, "
          f"{adapter.visibility})")


def cmd_build_demo_model(args: argparse.Namespace) -> None:
    from engine.demo_model import ensure_demo_model

    print(ensure_demo_model(_home()))


def cmd_web(args: argparse.Namespace) -> None:
    import uvicorn

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")
    _refuse_busy_port(args.host, args.port, hint="atrium web --port {port}")
    uvicorn.run("atrium.asgi:application", host=args.host, port=args.port,
                log_level="info", log_config=None,  # Django's LOGGING: JSON, redacted
                **server_options())


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # NOTE: the same option uvicorn binds with, so a port in TIME_WAIT counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _refuse_busy_port(host: str, port: int, *, hint: str) -> None:
    """One clear line instead of a server's traceback when the port is taken."""
    try:
        free = _port_free(host, port)
    except OSError as exc:
        sys.exit(f"atrium: cannot listen on {host}:{port}: {exc.strerror}")
    if free:
        return
    other = next((p for p in range(port + 1, min(port + 100, 65536)) if _port_free(host, p)),
                 None)
    suggestion = f"; try `{hint.format(port=other)}`" if other else ""
    sys.exit(f"atrium: port {port} is in use{suggestion}")


def server_options() -> dict:
    """How uvicorn serves Atrium (the tests' server uses the same)."""
    from django.conf import settings

    # A websocket message is held to the same limit as an HTTP body.
    return {"lifespan": "off", "ws": "websockets-sansio",
            "ws_max_size": settings.ATRIUM_MAX_BODY_BYTES}


def _model() -> tuple[Path, str]:
    _django()
    from atrium.inference.served_models import model_path_and_name

    return model_path_and_name()


def cmd_engine(args: argparse.Namespace) -> None:
    from engine.worker import engine_factory_from_args, run_worker

    path, name = (Path(args.model_dir), args.model_name or Path(args.model_dir).name) \
        if args.model_dir else _model()
    _django()
    from django.conf import settings

    # The store the platform registers adapters into, and its Redis (settings.py).
    args.adapter_store = args.adapter_store or str(settings.ATRIUM_ADAPTER_STORE)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a clean stop: requests end, it deregisters
        signal.signal(sig, lambda *_: stop.set())
    run_worker(redis_url=settings.REDIS_URL, model_dir=path, model_name=name,
               engine_id=args.engine_id, engine_factory=engine_factory_from_args(args),
               metrics_port=args.metrics_port, metrics_host=args.metrics_host, stop=stop)


def cmd_worker(args: argparse.Namespace) -> None:
    _django()
    from atrium.celery import app

    argv = ["worker", "--loglevel=INFO", f"--concurrency={args.concurrency}"]
    if not args.no_beat:
        beat_db = _home() / "celerybeat-schedule"
        argv += ["--beat", f"--schedule={beat_db}"]
    app.worker_main(argv)


def _wait_http(url: str, timeout: float) -> bool:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return True
        except OSError:
            time.sleep(0.3)
    return False


def _wait_engine(model: str, timeout: float) -> bool:
    from atrium.redis import sync_client
    from engine import protocol

    client, end = sync_client(), time.time() + timeout
    while time.time() < end:
        since = time.time() - protocol.HEARTBEAT_TTL_S
        for engine_id in client.zrangebyscore(protocol.ENGINES_ZSET, since, "+inf"):
            raw = client.get(protocol.engine_key(engine_id.decode()))
            if raw and protocol.EngineHeartbeat.decode(raw).model == model:
                return True
        time.sleep(0.3)
    return False


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _demo_key(*, new_key: bool) -> str | None:
    """The demo tenant's key: made on the first start (and on ``--new-key``), shown once.

    Later starts mint nothing (a key per start would pile up live, non-expiring secrets).
    """
    from tenants.selectors import api_key_denial, api_key_list
    from tenants.services import tenant_get_or_create

    tenant = tenant_get_or_create(name="Demo", slug="demo")
    has_key = any(api_key_denial(key) is None
                  for key in api_key_list(tenant=tenant).filter(name=DEMO_KEY_NAME))
    if has_key and not new_key:
        return None
    return _new_key(tenant, name=DEMO_KEY_NAME, scopes=DEMO_KEY_SCOPES, expires_in=None)


def cmd_up(args: argparse.Namespace) -> None:
    # SIGTERM (a service manager, `kill`) stops everything as Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    _refuse_busy_port(args.host, args.port, hint="make up PORT={port}")
    home = _home()
    if os.environ.get("REDIS_URL"):
        _up(args, home)
        return
    from atrium.embedded_redis import EmbeddedRedis

    redis_server = EmbeddedRedis(home / "redis")
    os.environ["REDIS_URL"] = redis_server.start()
    try:
        # Other `atrium` commands on this ATRIUM_HOME (revoke-key from another terminal)
        # find this Redis through the file while it runs (settings.py).
        (home / "redis.url").write_text(redis_server.url)
        print(f"embedded Redis at {redis_server.url}")
        _up(args, home)
    finally:  # whatever stopped the rest, a start-up error included
        (home / "redis.url").unlink(missing_ok=True)
        redis_server.stop()


def _up(args: argparse.Namespace, home: Path) -> None:
    demo_model = not os.environ.get("ATRIUM_MODEL")
    if demo_model:
        from engine.demo_model import demo_model_dir, ensure_demo_model

        if not (demo_model_dir(home) / "config.json").exists():
            print("building the demo model (once; cached under ATRIUM_HOME)...", flush=True)
        os.environ["ATRIUM_MODEL"] = str(ensure_demo_model(home))
        os.environ.setdefault("ATRIUM_MODEL_NAME", "atrium-demo")
    _django()
    from django.core.management import call_command

    from atrium.inference.served_models import model_path_and_name

    call_command("migrate", interactive=False, verbosity=0)
    api_key = _demo_key(new_key=args.new_key)
    _, model_name = model_path_and_name()

    exe = [sys.executable, "-m", "atrium.cli"]
    children = [
        subprocess.Popen(exe + ["web", "--host", args.host, "--port", str(args.port)]),
        subprocess.Popen(exe + ["engine"]),
        subprocess.Popen(exe + ["worker", "--concurrency", "1"]),
    ]
    base = f"http://{args.host}:{args.port}"
    try:
        if not _wait_http(f"{base}/healthz", 60):
            raise SystemExit("atrium: the web server did not start; see the log above")
        if not _wait_engine(model_name, 300):
            raise SystemExit("atrium: the engine did not start; see the log above")
        print(_banner(base, model_name, api_key, demo_model=demo_model), flush=True)
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
        raise SystemExit("atrium: a process exited; stopped the rest")
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()


def _banner(base: str, model: str, key: str | None, *, demo_model: bool) -> str:
    if key:
        about_key = f"API key for tenant 'demo' (shown once): {key}"
    else:
        key = "$ATRIUM_API_KEY"
        about_key = ("The demo tenant's key was shown on the first start. Another one:\n"
                     f"  export ATRIUM_API_KEY=$(atrium create-key demo --scopes "
                     f"{','.join(DEMO_KEY_SCOPES)} --expires-in 30d)\n"
                     "  (or restart with `atrium up --new-key`)")
    about_model = ""
    if demo_model:
        about_model = f"""
'{model}' is a tiny model built on this machine from random weights, so it answers
word salad: enough to try every feature, not to judge answers. To serve a real
Llama-family checkpoint in Hugging Face layout: ATRIUM_MODEL=/path/to/model make up
"""
    return f"""
Atrium is up at {base}  (Ctrl-C stops everything)
Console: {base}/console/
{about_key}
{about_model}
curl -N {base}/v1/chat/completions \\
  -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "stream": true, "max_tokens": 32,
       "messages": [{{"role": "user", "content": "Tell me about the sea."}}]}}'

python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
for chunk in client.chat.completions.create(
        model="{model}", stream=True, max_tokens=32,
        messages=[{{"role": "user", "content": "Tell me about the sea."}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY
"""


def build_parser() -> argparse.ArgumentParser:
    from engine.worker import add_engine_arguments

    parser = argparse.ArgumentParser(prog="atrium", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    port = int(os.environ.get("ATRIUM_PORT") or 8000)
    up = sub.add_parser("up", help="web + engine + Celery worker and beat, on embedded defaults")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=port, help="default: ATRIUM_PORT or 8000")
    up.add_argument("--new-key", action="store_true",
                    help="mint another key for the demo tenant and show it")
    up.set_defaults(func=cmd_up)

    web = sub.add_parser("web", help="the ASGI web server (API, websockets, console)")
    web.add_argument("--host", default="127.0.0.1")
    web.add_argument("--port", type=int, default=port, help="default: ATRIUM_PORT or 8000")
    web.set_defaults(func=cmd_web)

    eng = sub.add_parser("engine", help="one engine worker")
    eng.add_argument("--model-dir", help="Hugging Face layout directory (default: ATRIUM_MODEL)")
    eng.add_argument("--model-name")
    eng.add_argument("--engine-id")
    add_engine_arguments(eng)
    eng.set_defaults(func=cmd_engine)

    worker = sub.add_parser("worker", help="Celery worker with beat")
    worker.add_argument("--concurrency", type=int, default=2)
    worker.add_argument("--no-beat", action="store_true")
    worker.set_defaults(func=cmd_worker)

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
