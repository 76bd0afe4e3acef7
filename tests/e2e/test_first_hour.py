"""A new user's first hour, against the real `atrium up` on both setups (conftest.py)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from tests.e2e.conftest import Atrium, demo_checkpoint, wait_for

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking"]
PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


def test_chat_streams_with_the_openai_client(atrium: Atrium):
    stream = atrium.openai().chat.completions.create(
        model=atrium.model, messages=PROMPT, max_tokens=12, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].id.startswith("chatcmpl-")
    assert {c.id for c in chunks} == {chunks[0].id}
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    usage = chunks[-1].usage
    assert finish in ("length", "stop")
    assert 0 < usage.completion_tokens <= 12
    if finish == "length":
        assert usage.completion_tokens == 12


def test_the_banner_prompt_is_answered_with_words_at_the_default_temperature(atrium: Atrium):
    """The banner's example must print something: each sampled reply has visible text."""
    client = atrium.openai()
    replies = [client.chat.completions.create(model=atrium.model, messages=PROMPT, max_tokens=32,
                                              seed=seed).choices[0].message.content
               for seed in range(12)]
    assert all(reply and reply.strip() for reply in replies), replies


def test_websocket_runs_two_requests_and_cancels_one(atrium: Atrium):
    from websockets.sync.client import connect

    body = {"model": atrium.model, "messages": PROMPT, "max_tokens": 400}
    url = atrium.base.replace("http", "ws", 1) + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {atrium.key}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "short", "endpoint": "chat.completions",
                            "body": {**body, "max_tokens": 4}}))
        ws.send(json.dumps({"type": "request", "id": "long", "endpoint": "chat.completions",
                            "body": body}))
        ends: dict[str, str] = {}
        while len(ends) < 2:
            message = json.loads(ws.recv(timeout=60))
            if message["type"] == "chunk" and message["id"] == "long" and "long" not in ends:
                ws.send(json.dumps({"type": "cancel", "id": "long"}))
            if message["type"] in ("done", "cancelled", "error"):
                ends[message["id"]] = message["type"]
    assert ends == {"short": "done", "long": "cancelled"}


def _make_lora(base_dir: Path, out: Path, seed: int) -> Path:
    """A LoRA for the demo model as an ML engineer makes one: PEFT's save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    # NOTE: PEFT starts B at zero (the adapter would change nothing); random weights here,
    # on every linear layer: on q/v alone, the demo model's greedy answer (its training is
    # brief and its weights differ between CPUs) can stay the same on some machines.
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    get_peft_model(model, config).save_pretrained(out)
    return out


def test_uploaded_adapter_becomes_ready_and_changes_greedy_output(atrium: Atrium, tmp_path):
    base_dir = demo_checkpoint(atrium.home)
    lora = _make_lora(base_dir, tmp_path / "sea-poet", seed=1)
    began = time.monotonic()
    with atrium.http() as http:
        answer = http.post("/api/v1/tenants/demo/adapters", data={"name": "sea-poet"}, files={
            "adapter_config": (lora / "adapter_config.json").read_bytes(),
            "adapter_model": (lora / "adapter_model.safetensors").read_bytes()})
        assert answer.status_code in (201, 202), answer.text
        adapter = answer.json()

        def ready():
            state = http.get(f"/api/v1/tenants/demo/adapters/{adapter['id']}").json()
            assert state["status"] != "failed", state
            return state["status"] == "ready"

        wait_for(ready, timeout=60, interval=0.5, what="the adapter to become ready")
    print(f"adapter ready {time.monotonic() - began:.1f}s after upload ({atrium.setup})")
    client = atrium.openai()
    name = f"{atrium.model}:sea-poet"
    assert name in {m.id for m in client.models.list()}

    def greedy(model: str, content: str) -> str:
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=16,
            temperature=0).choices[0].message.content

    prompts = ["Tell me about the sea.", "Write a line about rain.", "Name three colours."]
    assert greedy(name, prompts[0]) == greedy(name, prompts[0])
    adapted = [greedy(name, p) for p in prompts]
    assert adapted != [greedy(atrium.model, p) for p in prompts]


def _usage_of_key(http, key_id: int, since: datetime) -> dict:
    page = http.get("/api/v1/tenants/demo/usage", params={
        "start_time": int(since.timestamp()), "bucket_width": "1d", "group_by": "api_key_id",
        "api_key_ids": key_id}).json()
    results = [r for bucket in page["data"] for r in bucket["results"]]
    total = {"requests": 0, "input": 0, "output": 0, "amount": Decimal(0), "currency": set()}
    for r in results:
        total["requests"] += r["num_model_requests"]
        total["input"] += r["input_tokens"]
        total["output"] += r["output_tokens"]
        total["amount"] += Decimal(r["amount"]["value"])
        total["currency"].add(r["amount"]["currency"])
    return total


def _export(http, fmt: str, start: datetime, end: datetime) -> tuple[list[dict], bytes]:
    answer = http.post("/api/v1/tenants/demo/exports", json={
        "kind": "ledger", "format": fmt, "start": start.isoformat(), "end": end.isoformat()})
    assert answer.status_code == 202, answer.text
    export_id = answer.json()["id"]

    def finished():
        state = http.get(f"/api/v1/tenants/demo/exports/{export_id}").json()
        assert state["status"] != "failed", state
        return state if state["status"] == "succeeded" else None

    state = wait_for(finished, timeout=60, interval=0.5, what=f"the {fmt} export")
    download = http.get(state["download_url"])
    assert download.status_code == 200
    body = download.content
    assert hashlib.sha256(body).hexdigest() == download.headers["x-content-sha256"]
    assert download.headers["x-content-sha256"] == state["sha256"]
    text = body.decode()
    rows = list(csv.DictReader(io.StringIO(text))) if fmt == "csv" else \
        [json.loads(line) for line in text.splitlines()]
    assert len(rows) == state["rows"]
    return rows, body


def test_ledger_exports_match_the_usage_api(atrium: Atrium):
    # A key of its own, from the CLI, so other tests' requests do not move the totals.
    made = atrium.cli("create-key", "demo", "--scopes", "inference,usage,billing",
                      "--expires-in", "1d", "--name", "export check")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    key_id = int(re.search(r"created key (\d+) ", made.stderr).group(1))
    since = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    client = atrium.openai(key)
    ids = {client.chat.completions.create(model=atrium.model, messages=PROMPT,
                                          max_tokens=5 + i).id for i in range(3)}
    ids.add(client.completions.create(model=atrium.model, prompt="The sea", max_tokens=7).id)
    with atrium.http(key) as http:
        usage = wait_for(lambda: (u := _usage_of_key(http, key_id, since))["requests"] == 4
                         and u, timeout=60, interval=0.5, what="usage to be ingested")
        for fmt in ("csv", "jsonl"):
            rows, _ = _export(http, fmt, since, since + timedelta(days=1))
            mine = [r for r in rows if int(r["api_key_id"]) == key_id]
            assert {r["request_id"] for r in mine} == ids  # the ids the client saw
            assert len(mine) == usage["requests"]
            assert sum(int(r["prompt_tokens"]) for r in mine) == usage["input"]
            assert sum(int(r["completion_tokens"]) for r in mine) == usage["output"]
            assert sum(Decimal(str(r["cost"])) for r in mine) == usage["amount"]
            assert {r["currency"] for r in mine} == usage["currency"] == {"USD"}


def test_a_key_from_the_cli_has_only_its_scopes(atrium: Atrium):
    refused = atrium.cli("create-key", "demo", "--scopes", "inference,telepathy")
    assert refused.returncode != 0
    assert "telepathy" in refused.stderr and "inference" in refused.stderr
    made = atrium.cli("create-key", "demo", "--scopes", "inference", "--expires-in", "2h")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert re.fullmatch(r"atr_\w+", key)
    reply = atrium.openai(key).chat.completions.create(model=atrium.model, messages=PROMPT,
                                                       max_tokens=2)
    assert reply.id.startswith("chatcmpl-") and reply.usage.completion_tokens > 0
    with atrium.http(key) as http:
        denied = http.get("/api/v1/tenants/demo/usage", params={"start_time": 0})
    assert denied.status_code == 403
    assert denied.json()["error"]["message"]


def test_console_sign_in_by_email_shows_the_request_just_made(atrium: Atrium):
    if not CHROMIUM.exists():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no Chromium at {CHROMIUM}")
    email = f"dev-{atrium.setup}@example.com"
    made = atrium.cli("create-user", email, "--tenant", "demo", "--role", "owner",
                      "--password-stdin", input="correct horse battery\n")
    assert made.returncode == 0, made.stderr
    request_id = atrium.openai().chat.completions.create(
        model=atrium.model, messages=PROMPT, max_tokens=3).id
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(base_url=atrium.base, viewport={"width": 1280, "height": 800})
        page.goto("/console/")
        assert "/console/login" in page.url
        page.fill("input[name=username]", email.upper())  # sign in by email, any case
        page.fill("input[name=password]", "correct horse battery")
        page.click("button[type=submit]")
        page.wait_for_url(lambda url: "/login" not in url)

        def listed():
            page.goto("/console/t/demo/logs")
            return request_id in page.content()

        wait_for(listed, timeout=30, interval=1, what="the request in the console's log")
        browser.close()
