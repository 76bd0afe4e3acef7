"""`atrium up`: web, engine and Celery worker in one process tree, on embedded defaults
(an embedded Redis, SQLite, the demo model) unless REDIS_URL / DATABASE_URL / ATRIUM_MODEL
name real ones."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from atrium.cli_support import atrium_home, django_setup, new_key, refuse_busy_port
from atrium.lanes import LANES

# What `atrium up` gives its one key: what a solo developer does in the first hour (call
# models, upload adapters, read usage, export the bill), not tenant administration.
DEMO_KEY_NAME = "demo key (atrium up)"
DEMO_KEY_SCOPES = ("inference", "adapters", "usage", "billing")
# Each process's metrics endpoint, on consecutive ports from --metrics-port, loopback only.
METRICS_OF = ("web", "engine", "worker")
METRICS_HOST = "127.0.0.1"
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _wait_http(url: str, timeout: float) -> bool:
    """Until ``url`` answers 200 (``/livez``: the web process; ``/readyz``: everything)."""
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:  # refused, or an HTTPError: 503 until ready
            time.sleep(0.3)
    return False


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _demo_key(*, another: bool) -> str | None:
    """The demo tenant's key: made on the first start (and on ``--new-key``), shown once.

    Later starts mint nothing (a key per start would pile up live, non-expiring secrets).
    """
    from tenants.selectors import api_key_denial, api_key_list
    from tenants.services import tenant_get_or_create

    tenant = tenant_get_or_create(name="Demo", slug="demo")
    has_key = any(api_key_denial(key) is None
                  for key in api_key_list(tenant=tenant).filter(name=DEMO_KEY_NAME))
    if has_key and not another:
        return None
    return new_key(tenant, name=DEMO_KEY_NAME, scopes=DEMO_KEY_SCOPES, expires_in=None)


def cmd_up(args: argparse.Namespace) -> None:
    # SIGTERM (a service manager, `kill`) stops everything as Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    refuse_busy_port(args.host, args.port, hint="make up PORT={port}")
    if args.metrics_port is None:
        args.metrics_port = args.port + 1
    for offset in range(len(METRICS_OF)):
        refuse_busy_port(METRICS_HOST, args.metrics_port + offset,
                         hint="atrium up --metrics-port {port}")
    home = atrium_home()
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
    demo_model = not os.environ.get("ATRIUM_MODEL") and not os.environ.get("ATRIUM_MODELS")
    if demo_model:
        from engine.demo_model import (
            demo_embedding_model_dir,
            demo_model_dir,
            ensure_demo_embedding_model,
        )

        # The demo chat model and, made from it, a demo embedding model (/v1/embeddings):
        # built, or built below.
        name = os.environ.get("ATRIUM_MODEL_NAME") or "atrium-demo"
        os.environ["ATRIUM_MODELS"] = (f"{name}={demo_model_dir(home)},"
                                       f"{name}-embedding={demo_embedding_model_dir(home)}")
    django_setup()  # settings and the Celery broker refused before a minute of training
    if demo_model and not (demo_embedding_model_dir(home) / "config.json").exists():
        print("building the demo models (once; cached under ATRIUM_HOME)...", flush=True)
        ensure_demo_embedding_model(home)  # the chat model first
    from django.core.management import call_command

    from core.served_models import model_paths
    from engine.options import threads_each

    models = list(model_paths())
    exe = [sys.executable, "-m", "atrium.cli"]
    web_metrics, engine_metrics, worker_metrics = (
        ["--metrics-port", str(args.metrics_port + offset), "--metrics-host", METRICS_HOST]
        for offset in range(len(METRICS_OF)))
    # One engine per served model (the first one's metrics as above, the others' on the
    # ports after the worker's), started first: an engine needs no database, and loads its
    # model while the database is migrated. Stopping, an engine finishes what it holds
    # while the web server waits for those streams, within the 15 s each process gets below.
    # Engines on this host's CPU split its cores, unless the operator set their threads.
    threads = [] if os.environ.get("ATRIUM_ENGINE_THREADS") \
        else ["--threads", str(threads_each(len(models)))]
    children = [
        subprocess.Popen(exe + ["engine", "--model-name", name, "--drain-seconds", "10",
                                *threads,
                                *(engine_metrics if i == 0 else _extra_metrics(args, i))])
        for i, name in enumerate(models)]
    base = f"http://{args.host}:{args.port}"
    try:
        call_command("migrate", interactive=False, verbosity=0)
        api_key = _demo_key(another=args.new_key)
        worker_env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(
            _fresh_dir(home / "metrics" / "worker"))}
        children += [
            subprocess.Popen(exe + ["web", "--host", args.host, "--port", str(args.port),
                                    *web_metrics]),
            # One worker per lane of background work (atrium/lanes.py): what a tenant can
            # slow down never holds up the ledger's tasks, and on one host the jobs and
            # batches lanes take only the CPU web and engine leave. The core lane runs the
            # beat and serves the metrics every lane's processes write.
            *(subprocess.Popen(exe + ["worker", "--lane", lane, *(
                worker_metrics if lane == "core" else ["--no-beat"])], env=worker_env)
              for lane in LANES),
        ]
        if not _wait_http(f"{base}/livez", 60):
            raise SystemExit("atrium: the web server did not start; see the log above")
        if not _wait_http(f"{base}/readyz", 300):
            raise SystemExit(f"atrium: not ready ({base}/readyz says what is missing: the "
                             "engine, the database or Redis); see the log above")
        print(_banner(base, models, api_key, demo_model=demo_model,
                      metrics_port=args.metrics_port), flush=True)
        _watch(children)
    except KeyboardInterrupt:
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()


def _watch(children: list[subprocess.Popen]) -> None:
    """Until Ctrl-C or SIGTERM (returns) or a child's exit (raises SystemExit).

    Ctrl-C reaches every process of the terminal's group at once, so a child may exit on it
    before this process would have run its handler: the signals are blocked and waited for
    instead, and a child's exit while one is pending is a stop, not a failure.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # no child is started after this
    while all(c.poll() is None for c in children):
        if signal.sigtimedwait(STOP_SIGNALS, 0.5) is not None:
            return
    if signal.sigtimedwait(STOP_SIGNALS, 0) is not None:  # pending: taken, not delivered
        return
    raise SystemExit("atrium: a process exited; stopped the rest")


def _fresh_dir(path: Path) -> Path:
    """``path``, empty: the last run's metric files would add to this one's."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _extra_metrics(args: argparse.Namespace, i: int) -> list[str]:
    """The metrics flags of the engine of the (i+1)th served model, i >= 1."""
    return ["--metrics-port", str(args.metrics_port + len(METRICS_OF) + i - 1),
            "--metrics-host", METRICS_HOST]


def _metrics_lines(port: int, models: list[str]) -> str:
    lines = [f"  {what:<8}http://{METRICS_HOST}:{port + offset}/metrics"
             for offset, what in enumerate(METRICS_OF)]
    lines += [f"  engine of {name}: http://{METRICS_HOST}:{port + len(METRICS_OF) + i}/metrics"
              for i, name in enumerate(models[1:])]
    return "\n".join(lines)


def _banner(base: str, models: list[str], key: str | None, *, demo_model: bool,
            metrics_port: int) -> str:
    model = models[0]
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
Models: {", ".join(models)}
Prometheus metrics (this machine only; docs/observability.md):
{_metrics_lines(metrics_port, models)}
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
