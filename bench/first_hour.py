"""A new user's first hour, timed step by step on this machine, through what a user has.

Steps: install (`make install` in a fresh clone, optional), the first `atrium up` on an
empty ATRIUM_HOME (it builds the demo model), the first streamed token, a PEFT adapter
from upload to `ready`, a ledger export from request to `succeeded`, and a warm start
(same home, model built, database migrated). The peer in the same run is the cold start
against the warm one. Nothing here imports the project: it drives `atrium`, REST and the
openai package as the user does.

    .venv/bin/python bench/first_hour.py [--install] [--out bench/results/first_hour.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))
from tests.ports import free_port as _port  # noqa: E402


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATRIUM_", "CELERY_"))
           and k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    return {**env, "ATRIUM_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{env['PATH']}"}


def _start(home: Path, port: int, extra_env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen, list[str], float]:
    began = time.monotonic()
    proc = subprocess.Popen([str(BIN / "atrium"), "up", "--port", str(port)],
                            env={**_env(home), **(extra_env or {})},
                            cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                     daemon=True).start()
    while not re.search(r"^Atrium is up at .*?^PY$", "".join(lines), re.M | re.S):
        if proc.poll() is not None or time.monotonic() - began > 600:
            raise SystemExit("atrium up did not start:\n" + "".join(lines)[-4000:])
        time.sleep(0.1)
    return proc, lines, time.monotonic() - began


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)


def _wait(predicate, timeout: float = 120) -> float:
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise SystemExit("timed out")
        time.sleep(0.1)
    return time.monotonic() - began


def _install() -> float:
    clone = Path(tempfile.mkdtemp(prefix="atrium-clone-"))
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        began = time.monotonic()
        subprocess.run(["make", "install"], cwd=clone, check=True, capture_output=True)
        return time.monotonic() - began
    finally:
        shutil.rmtree(clone, ignore_errors=True)


def _lora(base: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)


def run(install: bool) -> dict[str, float]:
    from openai import OpenAI

    times: dict[str, float] = {}
    if install:
        times["install (make install, fresh clone)"] = _install()
    home = Path(tempfile.mkdtemp(prefix="atrium-first-hour-"))
    port = _port()
    base = f"http://127.0.0.1:{port}"
    try:
        proc, lines, times["first start (builds the demo model)"] = _start(home, port)
        key = re.search(r"\(shown once\): (atr_\w+)", "".join(lines)).group(1)
        client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        began = time.monotonic()
        for chunk in client.chat.completions.create(
                model="atrium-demo", stream=True, max_tokens=16,
                messages=[{"role": "user", "content": "Hello"}]):
            if chunk.choices and chunk.choices[0].delta.content:
                times["first token (streamed chat, from request)"] = time.monotonic() - began
                break
        http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"},
                            timeout=60)
        lora = home / "lora"
        _lora(next(p for p in (home / "models").glob("atrium-demo-*")
                   if not p.name.startswith("atrium-demo-embedding-")), lora)
        began = time.monotonic()
        adapter = http.post("/api/v1/tenants/demo/adapters", data={"name": "first"}, files={
            "adapter_config": (lora / "adapter_config.json").read_bytes(),
            "adapter_model": (lora / "adapter_model.safetensors").read_bytes()}).json()
        _wait(lambda: http.get(f"/api/v1/tenants/demo/adapters/{adapter['id']}")
              .json()["status"] == "ready")
        times["adapter upload to ready"] = time.monotonic() - began
        day = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        began = time.monotonic()
        export = http.post("/api/v1/tenants/demo/exports", json={
            "kind": "ledger", "format": "csv", "start": day.isoformat(),
            "end": (day + timedelta(days=1)).isoformat()}).json()
        _wait(lambda: http.get(f"/api/v1/tenants/demo/exports/{export['id']}")
              .json()["status"] == "succeeded")
        times["ledger export to succeeded"] = time.monotonic() - began
        _stop(proc)
        proc, _, times["warm start (same home)"] = _start(home, port)
        _stop(proc)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return {step: round(seconds, 2) for step, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="also time `make install`")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/first_hour.json")
    args = parser.parse_args()
    times = run(args.install)
    result = {"machine": f"{os.cpu_count()} cores, {sys.platform}", "seconds": times}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| step | seconds |\n| --- | ---: |")
    for step, seconds in times.items():
        print(f"| {step} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
