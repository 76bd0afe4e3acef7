"""Adapter uploads end to end: API -> Celery validation -> engine -> the openai client.

A real Celery worker (in a thread, on the test Redis) validates uploads; a real engine
serves them from the adapter store.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.adapters.test_archive import make_zip
from tests.engine.lora_testing import peft_greedy, train_adapter
from tests.factories import key_factory, member_factory, tenant_factory
from tests.live import start_engine


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-uploads")
    out = {"sql": train_adapter(tiny_model_path, root / "sql", seed=21, r=8),
           "big-rank": train_adapter(tiny_model_path, root / "big", seed=22, r=128, steps=1)}
    from tests.engine.test_llama_model import build_checkpoint

    other_base = build_checkpoint(root / "other-base", "LlamaConfig", {})
    out["wrong-base"] = train_adapter(other_base, root / "wrong", seed=23, r=8, steps=1)
    return out


@pytest.fixture
def store(adapter_store) -> Path:
    return adapter_store


@pytest.fixture
def lora_engine(served_model, tiny_model_path, store, redis_client):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    running = start_engine(tiny_model_path, served_model, "upload-engine", engine_factory=lambda d:
                           LLMEngine(EngineConfig(model_dir=d, adapter_store=store)))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


@pytest.fixture
def tenant(transactional_db):
    return tenant_factory("acme")


@pytest.fixture
def key(tenant):
    return key_factory(tenant, scopes=("inference", "adapters"))


def api(api_server: str, key) -> httpx.Client:
    return httpx.Client(base_url=f"{api_server}/api/v1/tenants/acme",
                        headers={"Authorization": f"Bearer {key.plaintext}"}, timeout=60)


def zip_of(folder: Path, tmp: Path) -> Path:
    return make_zip(tmp / f"{folder.name}.zip", {
        f"{folder.name}/{p.name}": p.read_bytes() for p in folder.iterdir()})


def wait_for(client: httpx.Client, adapter_id: int, timeout: float = 60) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        body = client.get(f"/adapters/{adapter_id}").json()
        if body["status"] in ("ready", "failed"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"adapter {adapter_id} never finished validating: {body}")


def store_contents(store: Path) -> list[str]:
    if not store.exists():
        return []
    return sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())


def test_zip_upload_becomes_ready_and_serves_what_peft_generates(
        api_server, celery_worker, lora_engine, key, trained, tiny_model_path, store, tmp_path):
    from core.served_models import served_models

    client = api(api_server, key)
    with zip_of(trained["sql"], tmp_path).open("rb") as f:
        res = client.post("/adapters", data={"name": "sql"}, files={"archive": ("sql.zip", f)})
    assert res.status_code == 202, res.text
    assert res.json()["status"] in ("uploaded", "validating", "ready")
    ready = wait_for(client, res.json()["id"])
    assert ready["status"] == "ready" and ready["model"] == "tiny-llama:sql@1"
    assert ready["rank"] == 8 and len(ready["content_hash"]) == 64
    assert not list((store / "uploads").rglob("*")) if (store / "uploads").exists() else True

    prompt = "Once upon a time"
    openai = OpenAI(base_url=f"{api_server}/v1", api_key=key.plaintext, max_retries=0)
    out = openai.completions.create(model="tiny-llama:sql", prompt=prompt, max_tokens=10,
                                    temperature=0)
    ids = served_models()["tiny-llama"].encode_prompt(prompt)
    expected = peft_greedy(tiny_model_path, trained["sql"], [ids], 10)[0]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    assert out.choices[0].text == tok.decode(expected, skip_special_tokens=True)

    # Deleting it: the model is gone for clients, and its files leave the store.
    assert client.delete(f"/adapters/{ready['id']}").status_code == 204
    with pytest.raises(Exception) as err:
        openai.completions.create(model="tiny-llama:sql", prompt=prompt, max_tokens=2)
    assert getattr(err.value, "status_code", None) == 404
    assert not (store / ready["content_hash"]).exists()


def test_resumable_chunked_upload_of_a_tar_gz(api_server, celery_worker, key, trained, store,
                                              tmp_path):
    archive = tmp_path / "sql.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for p in trained["sql"].iterdir():
            tf.add(p, arcname=f"sql/{p.name}")
    data = archive.read_bytes()
    client = api(api_server, key)
    upload = client.post("/adapter-uploads", json={"name": "sql", "size": len(data),
                                                   "filename": "sql.tar.gz"})
    assert upload.status_code == 201, upload.text
    url = f"/adapter-uploads/{upload.json()['id']}"
    step = len(data) // 3 + 1
    pieces = [(i, data[i:i + step]) for i in range(0, len(data), step)]

    def put(offset: int, piece: bytes) -> httpx.Response:
        return client.put(url, content=piece, headers={
            "Content-Range": f"bytes {offset}-{offset + len(piece) - 1}/{len(data)}",
            "Content-Type": "application/octet-stream"})

    assert put(*pieces[0]).json()["received"] == len(pieces[0][1])
    skipped = put(*pieces[2])  # out of order: refused, with where to resume
    assert skipped.status_code == 409 and f"resume from {len(pieces[0][1])}" in \
        skipped.json()["error"]["message"]
    assert client.post(f"{url}/complete").status_code == 409  # not all bytes yet
    assert client.get(url).json()["received"] == len(pieces[0][1])  # a client resumes here
    for offset, piece in pieces[1:]:
        assert put(offset, piece).status_code == 200
    done = client.post(f"{url}/complete")
    assert done.status_code == 202
    assert wait_for(client, done.json()["id"])["status"] == "ready"
    assert client.get(url).status_code == 404  # the upload is gone once validated


def test_the_two_files_can_be_sent_as_they_are(api_server, celery_worker, key, trained, store):
    client = api(api_server, key)
    folder = trained["sql"]
    with (folder / "adapter_config.json").open("rb") as c, \
            (folder / "adapter_model.safetensors").open("rb") as w:
        res = client.post("/adapters", data={"name": "sql"},
                          files={"adapter_config": c, "adapter_model": w})
    assert res.status_code == 202, res.text
    assert wait_for(client, res.json()["id"])["status"] == "ready"


def _variant_zip(folder: Path, tmp: Path, name: str, change=None, extra=None,
                 drop=()) -> Path:
    members = {f"x/{p.name}": p.read_bytes() for p in folder.iterdir() if p.name not in drop}
    if change:
        config = json.loads(members["x/adapter_config.json"])
        members["x/adapter_config.json"] = json.dumps({**config, **change}).encode()
    members.update(extra or {})
    return make_zip(tmp / f"{name}.zip", members)


@pytest.mark.parametrize("case, reason", [
    ("corrupt", "corrupt"),
    ("pickle", "pickle"),
    ("wrong-base", "another model"),
    ("rank", "above"),
    ("traversal", "climbs out"),
    ("symlink", "symbolic link"),
    ("bomb", "expands to more than"),
    ("not-json", "not valid JSON"),
    ("nested-json", "nested too deeply"),
    ("bad-tensors", "cannot be read"),
    ("odd-config", "must be a positive integer"),
])
def test_bad_uploads_fail_with_a_reason_and_leave_nothing(api_server, celery_worker, key,
                                                         trained, store, tmp_path, settings,
                                                         case, reason):
    settings.ATRIUM_ADAPTER_MAX_UPLOAD_BYTES = 20 << 20
    sql = trained["sql"]
    if case == "corrupt":
        path = zip_of(sql, tmp_path)
        path.write_bytes(path.read_bytes()[:200])
    elif case == "pickle":
        path = _variant_zip(sql, tmp_path, case, drop=("adapter_model.safetensors",),
                            extra={"x/adapter_model.bin": b"\x80\x04\x95pickle"})
    elif case == "wrong-base":
        path = zip_of(trained["wrong-base"], tmp_path)
    elif case == "rank":
        path = zip_of(trained["big-rank"], tmp_path)
    elif case == "traversal":
        path = _variant_zip(sql, tmp_path, case, extra={"../../evil.txt": b"x"})
    elif case == "symlink":
        path = make_zip(tmp_path / "link.zip", {f"x/{p.name}": p.read_bytes()
                                                for p in sql.iterdir()},
                        symlinks={"x/evil": "/etc/passwd"})
    elif case == "bomb":
        path = _variant_zip(sql, tmp_path, case, drop=("adapter_model.safetensors",),
                            extra={"x/adapter_model.safetensors": b"\0" * (40 << 20)})
    elif case == "nested-json":
        path = _variant_zip(sql, tmp_path, case, drop=("adapter_config.json",),
                            extra={"x/adapter_config.json": b"[" * 100_000 + b"]" * 100_000})
    elif case == "bad-tensors":  # a safetensors header that claims 2 GiB of JSON
        path = _variant_zip(sql, tmp_path, case, drop=("adapter_model.safetensors",),
                            extra={"x/adapter_model.safetensors": (2**31).to_bytes(8, "little")
                                   + b"{}"})
    elif case == "odd-config":
        path = _variant_zip(sql, tmp_path, case, change={"r": {"eight": 8}, "lora_alpha": [16]})
    else:
        path = _variant_zip(sql, tmp_path, case, drop=("adapter_config.json",),
                            extra={"x/adapter_config.json": b"{not json"})
    client = api(api_server, key)
    with path.open("rb") as f:
        res = client.post("/adapters", data={"name": "bad"}, files={"archive": ("a.zip", f)})
    assert res.status_code == 202, res.text
    failed = wait_for(client, res.json()["id"])
    assert failed["status"] == "failed"
    assert reason in failed["failure_reason"]
    assert failed["content_hash"] == ""
    assert store_contents(store) == []  # no adapter, no leftover upload bytes


def test_an_upload_over_the_size_limit_is_refused_up_front(api_server, key, store, settings):
    settings.ATRIUM_ADAPTER_MAX_UPLOAD_BYTES = 1000
    client = api(api_server, key)
    res = client.post("/adapters", data={"name": "big"},
                      files={"archive": ("a.zip", io.BytesIO(b"PK\x03\x04" + b"\0" * 5000))})
    assert res.status_code == 400 and "1,000 bytes" in res.json()["error"]["message"]
    res = client.post("/adapter-uploads", json={"name": "big", "size": 10**12})
    assert res.status_code == 400
    from adapters.models import Adapter, AdapterUpload

    assert not Adapter.objects.exists() and not AdapterUpload.objects.exists()
    assert store_contents(store) == []


def test_only_a_known_uploader_may_send_more_than_the_ordinary_body_limit(api_server, key, tenant,
                                                                         store):
    from django.conf import settings as live

    body = b"\0" * (live.ATRIUM_MAX_BODY_BYTES + 1)
    url = f"{api_server}/api/v1/tenants/acme/adapters"
    other_key = key_factory(tenant_factory("globex"), scopes=("inference", "adapters"))
    inference_only = key_factory(tenant, scopes=("inference",))
    strangers = {"nobody": {}, "a bad key": {"Authorization": "Bearer atr_nonsense"},
                 "another tenant's key": {"Authorization": f"Bearer {other_key.plaintext}"},
                 "a key without the adapters scope": {
                     "Authorization": f"Bearer {inference_only.plaintext}"},
                 "a forged session": {"Cookie": "sessionid=forged"}}
    for who, headers in strangers.items():
        res = httpx.post(url, content=body, timeout=60,
                         headers={**headers, "Content-Type": "application/octet-stream"})
        assert res.status_code == 413, who
        assert "adapters scope" in res.json()["error"]["message"], who
    # The tenant's own key gets past the gate (and the view then judges the body).
    res = httpx.post(url, content=body, timeout=60, headers={
        "Authorization": f"Bearer {key.plaintext}", "Content-Type": "application/octet-stream"})
    assert res.status_code == 415  # not a form: the view's answer, past the gate
    session = signed_in(api_server, member_factory(tenant, "developer"))
    res = session.post("/api/v1/tenants/acme/adapters", content=body,
                       headers={"Content-Type": "application/octet-stream"})
    assert res.status_code == 415
    from adapters.models import AdapterUpload

    assert not AdapterUpload.objects.exists() and store_contents(store) == []


def test_tenants_never_see_or_touch_each_others_adapters(api_server, celery_worker, key,
                                                         trained, store, tmp_path):
    other = tenant_factory("globex")
    other_key = key_factory(other, scopes=("inference", "adapters"))
    theirs = httpx.Client(base_url=f"{api_server}/api/v1/tenants/globex", timeout=60,
                          headers={"Authorization": f"Bearer {other_key.plaintext}"})
    with zip_of(trained["sql"], tmp_path).open("rb") as f:
        their_sql = theirs.post("/adapters", data={"name": "sql"},
                                files={"archive": ("a.zip", f)}).json()
    wait_for(theirs, their_sql["id"])
    mine = api(api_server, key)
    # The same name in my tenant is my own version 1; theirs is untouched.
    with zip_of(trained["sql"], tmp_path).open("rb") as f:
        my_sql = mine.post("/adapters", data={"name": "sql"},
                           files={"archive": ("a.zip", f)}).json()
    assert my_sql["version"] == 1
    for method, path in [("GET", f"/adapters/{their_sql['id']}"),
                         ("DELETE", f"/adapters/{their_sql['id']}"),
                         ("POST", f"/adapters/{their_sql['id']}/visibility")]:
        assert mine.request(method, path, json={"public": True}).status_code == 404
    upload = theirs.post("/adapter-uploads", json={"name": "x", "size": 10}).json()
    assert mine.get(f"/adapter-uploads/{upload['id']}").status_code == 404
    # Their tenant's URL with my key: 404 too (keys see only their own tenant).
    assert mine.get(f"{api_server}/api/v1/tenants/globex/adapters").status_code == 404
    assert [a["id"] for a in mine.get("/adapters").json()["data"]] == [my_sql["id"]]
    # Both share one stored copy (same content); deleting mine keeps theirs.
    wait_for(mine, my_sql["id"])
    assert mine.delete(f"/adapters/{my_sql['id']}").status_code == 204
    assert (store / wait_for(theirs, their_sql["id"])["content_hash"]).exists()


def signed_in(api_server: str, user) -> httpx.Client:
    """A console session for ``user`` (a session cookie and the CSRF token it needs)."""
    from django.middleware.csrf import _get_new_csrf_string
    from django.test import Client

    django_client = Client()
    django_client.force_login(user)
    csrf = _get_new_csrf_string()
    return httpx.Client(base_url=api_server, timeout=30, cookies={
        "sessionid": django_client.cookies["sessionid"].value, "csrftoken": csrf},
        headers={"X-CSRFToken": csrf, "Referer": api_server})


def test_only_operators_publish_and_viewers_only_read(api_server, celery_worker, key, tenant,
                                                      trained, store, tmp_path):
    from django.contrib.auth import get_user_model

    client = api(api_server, key)
    with zip_of(trained["sql"], tmp_path).open("rb") as f:
        adapter = client.post("/adapters", data={"name": "sql"},
                              files={"archive": ("a.zip", f)}).json()
    assert client.post(f"/adapters/{adapter['id']}/visibility",
                       json={"public": True}).status_code == 403
    inference_only = key_factory(tenant, scopes=("inference",))
    limited = api(api_server, inference_only)
    assert limited.get("/adapters").status_code == 403
    assert limited.post("/adapter-uploads", json={"name": "x", "size": 5}).status_code == 403

    viewer = member_factory(tenant, "viewer")
    operator = get_user_model().objects.create_user(username="op", email="op@example.com",
                                                    is_staff=True)
    for user, expected_read, expected_publish in ((viewer, 200, 403), (operator, 200, 200)):
        session = signed_in(api_server, user)
        base = "/api/v1/tenants/acme"
        assert session.get(f"{base}/adapters").status_code == expected_read
        res = session.post(f"{base}/adapters/{adapter['id']}/visibility", json={"public": True})
        assert res.status_code == expected_publish, res.text
    from adapters.models import Adapter
    from tenants.models import AuditEvent

    assert Adapter.objects.get(pk=adapter["id"]).visibility == "public"
    assert client.delete(f"/adapters/{adapter['id']}").status_code == 204
    # Who made it, who published it (once: the refused tries left nothing) and who deleted it.
    trail = [(e.action, e.actor, (e.before or {}).get("visibility"),
              (e.after or {}).get("visibility"))
             for e in AuditEvent.objects.filter(tenant=tenant, target_type="adapter",
                                                target_id=str(adapter["id"]))
             .order_by("pk")]
    assert trail == [("adapter.create", f"key:{key.prefix}", None, "private"),
                     ("adapter.visibility", "user:op@example.com", "private", "public"),
                     ("adapter.delete", f"key:{key.prefix}", "public", None)]


def test_status_changes_are_pushed_over_a_websocket(api_server, celery_worker, key, trained,
                                                    store, tmp_path):
    import asyncio

    import websockets

    async def watch() -> list[str]:
        url = api_server.replace("http://", "ws://") + "/ws/tenants/acme/adapters"
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key.plaintext}"}) as ws:
            with zip_of(trained["sql"], tmp_path).open("rb") as f:
                await asyncio.to_thread(api(api_server, key).post, "/adapters",
                                        data={"name": "sql"}, files={"archive": ("a.zip", f)})
            seen = []
            while not seen or seen[-1] not in ("ready", "failed"):
                seen.append(json.loads(await asyncio.wait_for(ws.recv(), 30))["status"])
            return seen

    assert asyncio.run(watch()) == ["uploaded", "validating", "ready"]


def test_the_events_socket_refuses_strangers(api_server, key):
    import asyncio

    import websockets

    other_key = key_factory(tenant_factory("globex"), scopes=("adapters",))

    async def close_code(headers) -> int:
        url = api_server.replace("http://", "ws://") + "/ws/tenants/acme/adapters"
        async with websockets.connect(url, additional_headers=headers) as ws:
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code

    assert asyncio.run(close_code({"Authorization": f"Bearer {other_key.plaintext}"})) == 4403
    assert asyncio.run(close_code({})) == 4403


def test_an_engine_without_the_store_fetches_adapters_from_the_platform(
        api_server, celery_worker, key, trained, store, tmp_path, settings):
    from engine.lora.store import AdapterStore

    settings.ATRIUM_ENGINE_TOKEN = "engine-secret"
    client = api(api_server, key)
    with zip_of(trained["sql"], tmp_path).open("rb") as f:
        adapter = client.post("/adapters", data={"name": "sql"},
                              files={"archive": ("a.zip", f)}).json()
    digest = wait_for(client, adapter["id"])["content_hash"]
    remote = AdapterStore(tmp_path / "engine-cache", fetch_url=f"{api_server}/internal/adapters",
                          token="engine-secret")
    remote.fetch(digest)
    assert remote.exists(digest)
    wrong = AdapterStore(tmp_path / "x", fetch_url=f"{api_server}/internal/adapters",
                         token="guess")
    with pytest.raises(Exception, match="404"):
        wrong.fetch(digest)
    assert not (tmp_path / "x" / digest).exists()
    shutil.rmtree(tmp_path / "engine-cache")


def test_a_validation_that_keeps_failing_on_our_side_ends_failed_and_frees_its_upload(
        tenant, store):
    from adapters import services
    from adapters.models import Adapter, AdapterUpload

    upload = services.upload_create(tenant=tenant, name="stuck", base_model="m", size=4)
    services.upload_append(upload=upload, offset=0, data=io.BytesIO(b"PK\x03\x04"), length=4)
    adapter = services.upload_complete(upload=upload)
    assert store_contents(store) != []
    given_up = services.adapter_validate_gave_up(adapter_id=adapter.pk,
                                                 error=ConnectionError("storage away"))
    assert given_up.status == "failed" and "ConnectionError" in given_up.failure_reason
    assert store_contents(store) == [] and not AdapterUpload.objects.exists()
    # Late retries find it decided.
    assert services.adapter_validate(adapter_id=adapter.pk).status == "failed"
    assert Adapter.objects.get(pk=adapter.pk).failure_reason == given_up.failure_reason
