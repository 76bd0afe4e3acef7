"""Several base models at once (ATRIUM_MODELS): each its own engine pool, all listed,
adapters tied to their base; driven through the official openai client."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI

from core.served_models import served_models
from engine import protocol
from tests.engine.lora_testing import train_adapter
from tests.live import start_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_models(tiny_model_path, tmp_path) -> dict[str, Path]:
    second = tmp_path / "second-model"
    shutil.copytree(tiny_model_path, second)
    return {"tiny-llama": tiny_model_path, "tiny-two": second}


@pytest.fixture
def served_model(settings, two_models):  # tests/live.py's, with two base models
    settings.ATRIUM_MODEL = ""
    settings.ATRIUM_MODELS = {name: str(path) for name, path in two_models.items()}
    served_models.cache_clear()
    yield "tiny-llama"
    served_models.cache_clear()


@pytest.fixture
def second_pool(two_models, adapter_store, redis_client):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    running = start_engine(two_models["tiny-two"], "tiny-two", "engine-two",
                           engine_factory=lambda d: LLMEngine(EngineConfig(
                               model_dir=d, adapter_store=adapter_store, max_loras=2)))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


def _client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


def test_every_base_model_is_listed_and_each_runs_on_its_own_pool(
        api_server, tenant_key, second_pool, redis_client):
    client = _client(api_server, tenant_key)
    assert {"tiny-llama", "tiny-two"} <= {m.id for m in client.models.list()}
    answer = client.chat.completions.create(
        model="tiny-two", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert answer.model == "tiny-two" and answer.usage.completion_tokens > 0
    # Its request was placed on its own model's engine (taken, settled and deleted since).
    # NOTE: by ids, not XINFO's entries-added, which the embedded Redis (6.2) lacks.
    own = protocol.engine_stream("tiny-two", "engine-two")
    added = redis_client.xinfo_stream(own)["last-generated-id"]
    assert added not in (b"0-0", "0-0")
    assert [g["last-delivered-id"] for g in redis_client.xinfo_groups(own)] == [added]
    # The other pool has no engine: its model is unavailable, not served by this one.
    refused = httpx.post(f"{api_server}/v1/chat/completions", timeout=30,
                         headers={"Authorization": f"Bearer {tenant_key.key}"},
                         json={"model": "tiny-llama", "max_tokens": 4,
                               "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 503 and \
        refused.json()["error"]["code"] == "engine_unavailable"
    assert not redis_client.exists(protocol.request_stream("tiny-llama"))
    ready = httpx.get(f"{api_server}/readyz", timeout=30)
    assert ready.status_code == 503 and ready.json()["engines"] == {"tiny-llama": 0,
                                                                    "tiny-two": 1}


def test_an_adapter_runs_on_its_base_models_pool_only(api_server, tenant_key, second_pool,
                                                      two_models, tmp_path):
    from adapters.services import adapter_register
    from tenants.models import Tenant

    folder = train_adapter(two_models["tiny-two"], tmp_path / "sql", seed=11, r=8)
    adapter_register(tenant=Tenant.objects.get(slug=tenant_key.slug), name="sql",
                     source_dir=folder, base_model="tiny-two",
                     base_model_dir=two_models["tiny-two"])
    client = _client(api_server, tenant_key)
    listed = {m.id for m in client.models.list()}
    assert "tiny-two:sql" in listed and "tiny-llama:sql" not in listed
    answer = client.completions.create(model="tiny-two:sql", prompt="select", max_tokens=4)
    assert answer.usage.completion_tokens > 0
    with pytest.raises(NotFoundError):  # not an adapter of the other base model
        client.completions.create(model="tiny-llama:sql", prompt="select", max_tokens=4)


def test_an_engine_serves_the_model_it_is_told_and_must_be_told_when_several(served_model,
                                                                               settings):
    from atrium.cli import _model

    assert _model("tiny-two") == (Path(settings.ATRIUM_MODELS["tiny-two"]).resolve(),
                                  "tiny-two")
    with pytest.raises(SystemExit, match="several models are served"):
        _model(None)
    with pytest.raises(SystemExit, match="not a served model"):
        _model("nope")


@pytest.mark.parametrize("value, message", [
    ("just-a-name", "is not name=folder"),
    ("a=/x,a=/y", "is not name=folder"),
    ("bad name=/x", "is not name=folder"),
])
def test_a_malformed_model_list_stops_every_process_with_one_line(value, message):
    env = {**os.environ, "ATRIUM_MODELS": value, "ATRIUM_MODEL": "",
           "DJANGO_SETTINGS_MODULE": "atrium.settings",
           "PYTHONPATH": f"{ROOT / 'platform'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-m", "atrium.cli", "create-tenant", "x"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr
