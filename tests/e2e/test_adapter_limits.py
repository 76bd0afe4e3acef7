"""A plan's limit on resident adapters under the real `atrium up` (docs/engine.md, "Many
adapters, shared fairly"): an operator caps a plan at one adapter in the console, its
tenant's ML engineer uploads three, its developer calls all three at once through the
openai SDK beside another tenant's request; every request is answered, and the operator's
fleet page shows the engine holding one of the capped tenant's adapters in its slots."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.conftest import Atrium, console_post, demo_checkpoint, operator_console, wait_for
from tests.engine.lora_testing import random_adapter

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _capped_tenant(atrium: Atrium, console) -> tuple[str, str]:
    """A new tenant on a new plan holding one adapter resident; its slug and a key."""
    suffix = f"{atrium.setup}-{time.monotonic_ns()}"
    plan, tenant = f"one-adapter-{suffix}", f"capped-{suffix}"
    made = console_post(console, "/console/operator/plans", {
        "slug": plan, "name": "One adapter", "priority": "5", "requests_per_minute": "600",
        "tokens_per_minute": "1000000", "max_concurrent_requests": "16",
        "max_resident_adapters": "1"})
    assert made.status_code == 302 and made.headers["location"].endswith("/plans"), made.text
    listed = console.get("/console/operator/plans").text
    assert "1 adapter resident" in re.sub(r"<[^>]+>", "", listed)
    assert atrium.cli("create-tenant", "Capped", "--slug", tenant).returncode == 0
    moved = console_post(console, f"/console/operator/tenants/{tenant}/plan", {"plan": plan},
                         page=f"/console/operator/tenants/{tenant}")
    assert moved.status_code == 302, moved.text
    created = atrium.cli("create-key", tenant, "--scopes", "inference,adapters")
    assert created.returncode == 0, created.stderr
    return tenant, re.search(r"atr_\w+", created.stdout).group(0)


def _upload(atrium: Atrium, key: str, tenant: str, folder, name: str) -> str:
    """Uploads a PEFT folder as ``name``; its content hash once it is ready."""
    with atrium.http(key) as http:
        answer = http.post(f"/api/v1/tenants/{tenant}/adapters", data={"name": name}, files={
            "adapter_config": (folder / "adapter_config.json").read_bytes(),
            "adapter_model": (folder / "adapter_model.safetensors").read_bytes()})
        assert answer.status_code in (201, 202), answer.text
        adapter_id = answer.json()["id"]

        def ready():
            state = http.get(f"/api/v1/tenants/{tenant}/adapters/{adapter_id}").json()
            assert state["status"] != "failed", state
            return state["status"] == "ready" and state["content_hash"]

        return wait_for(ready, timeout=60, interval=0.5, what=f"adapter {name} to be ready")


def test_a_tenant_capped_at_one_adapter_is_served_and_holds_one_slot(atrium: Atrium, tmp_path):
    console = operator_console(atrium)
    tenant, key = _capped_tenant(atrium, console)
    base_dir = demo_checkpoint(atrium.home)
    hashes = {f"limit-{i}": _upload(atrium, key, tenant,
                                    random_adapter(base_dir, tmp_path / f"a{i}", seed=70 + i, r=8),
                                    f"limit-{i}")
              for i in range(3)}
    capped, other = atrium.openai(key), atrium.openai()

    def ask(client, model: str) -> str:
        answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                                temperature=0, extra_body={"ignore_eos": True})
        return answer.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        asked = [pool.submit(ask, capped, f"{atrium.model}:{name}") for name in hashes]
        asked.append(pool.submit(ask, other, atrium.model))
        assert [f.result(timeout=120) for f in asked] == ["length"] * 4

    def slots_shown() -> list[str]:
        page = console.get("/console/operator/fleet").text
        cells = re.findall(r'data-field="adapters">(.*?)</td>', page, re.S)
        return [code for cell in cells for code in re.findall(r"<code[^>]*>([0-9a-f]+)", cell)]

    # The heartbeat after the last request ended: one of the three in a slot, not three.
    time.sleep(1.5)
    shown = wait_for(slots_shown, timeout=10, what="the fleet page to list adapters")
    mine = [h for h in hashes.values() if any(h.startswith(s) for s in shown)]
    assert len(mine) == 1, (shown, hashes)
