"""The Files API against the real server: uploads checked as a stream and stored from disk
(a multi-megabyte file, a bad line far into one), expires_after and expiry, each tenant's
limits on files, bytes and batches, and an upload that holds up no inference request."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import httpx
import openai
import pytest
from django.core.files.storage import FileSystemStorage, storages
from django.utils import timezone

from batches import services as batch_services
from batches.models import Batch, BatchLine, File
from batches.storage import files_storage
from core.errors import ApiError
from tenants.models import Plan, Tenant
from tests.inference.test_batches import chat_line, client_for, jsonl
from tests.live import make_tenant_key


def padded_line(custom_id: str, pad: int) -> dict:
    line = chat_line(custom_id, "m")
    line["body"]["messages"][0]["content"] = "x" * pad
    return line


def big_file(lines: int, pad: int) -> bytes:
    return jsonl(*(padded_line(f"r{i}", pad) for i in range(lines)))


def stored_names() -> list[str]:
    """Every file in the files storage (FileSystemStorage: the tenants' folders)."""
    storage = files_storage()
    folders, _ = storage.listdir("") if storage.exists("") else ([], [])
    return sorted(f"{d}/{n}" for d in folders for n in storage.listdir(d)[1])


def upload(api_server: str, key: str, data: bytes, **fields) -> httpx.Response:
    return httpx.post(f"{api_server}/v1/files", headers={"Authorization": f"Bearer {key}"},
                      files={"file": ("in.jsonl", data)},
                      data={"purpose": "batch", **fields}, timeout=60)


@pytest.fixture(autouse=True)
def files_dir(settings, tmp_path):
    """A files storage of the test's own."""
    settings.STORAGES = {**settings.STORAGES, "atrium-files": {
        "BACKEND": settings.STORAGES["atrium-files"]["BACKEND"],
        "OPTIONS": {"location": str(tmp_path / "files")}}}
    storages._storages.pop("atrium-files", None)
    storages.backends = settings.STORAGES
    yield tmp_path / "files"
    storages._storages.pop("atrium-files", None)


# --- streamed uploads ----------------------------------------------------------------------

def test_a_multi_megabyte_file_is_accepted_stored_whole_and_summarized(api_server):
    acme = make_tenant_key("acme")
    data = big_file(3000, 3000)  # ~9 MB: past every in-memory threshold
    answer = upload(api_server, acme.key, data)
    assert answer.status_code == 200, answer.text
    file_id = answer.json()["id"]
    assert answer.json()["bytes"] == len(data)
    stored = File.objects.get(pk=file_id)
    assert (stored.lines, stored.endpoints) == (3000, {"/v1/chat/completions": 1})
    got = httpx.get(f"{api_server}/v1/files/{file_id}/content", timeout=60,
                    headers={"Authorization": f"Bearer {acme.key}"})
    assert got.content == data


def test_a_bad_line_far_into_a_large_file_is_named_and_nothing_is_stored(api_server):
    acme = make_tenant_key("acme")
    rows = [padded_line(f"r{i}", 2000) for i in range(3000)]
    data = jsonl(*rows[:2500], {**rows[2500], "method": "GET"}, *rows[2501:])
    answer = upload(api_server, acme.key, data)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_file", "file")
    assert "line 2501: method must be POST" in error["message"]
    assert File.objects.count() == 0 and stored_names() == []


# --- expiry --------------------------------------------------------------------------------

def test_expires_after_sets_expires_at_and_a_file_without_it_gets_the_default(api_server,
                                                                            settings):
    settings.ATRIUM_FILE_DEFAULT_EXPIRY_S = 86400 * 30
    client = client_for(api_server, make_tenant_key("acme").key)
    data = jsonl(chat_line("a", "m"))
    kept = client.files.create(file=("in.jsonl", data), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 7200})
    assert kept.expires_at == kept.created_at + 7200
    plain = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert plain.expires_at == plain.created_at + 86400 * 30
    assert client.files.retrieve(kept.id).expires_at == kept.expires_at


@pytest.mark.parametrize("path, param", [
    ("/v1/files/file-%00abc", None), ("/v1/batches/batch_%00", None),
    ("/v1/batches?after=%00", None), ("/v1/files?after=file-%00", None),
    ("/api/v1/tenants/acme/usage/requests/chatcmpl-%00", None),
    ("/v1/files?limit=%C2%B2", "limit"), ("/v1/batches?limit=" + "9" * 5000, "limit"),
])
def test_ids_and_parameters_no_database_takes_are_a_400_not_a_500(api_server, path, param):
    acme = make_tenant_key("acme")
    answer = httpx.get(f"{api_server}{path}", headers={"Authorization": f"Bearer {acme.key}"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize("fields, param", [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"},
     "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
     "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1h"},
     "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "\u00b2"},  # "²"
     "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "9" * 5000},
     "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
     "expires_after[anchor]"),
    ({"expires_after[seconds]": "3600"}, "expires_after[anchor]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600",
      "expires_after[days]": "1"}, "expires_after[days]"),
    ({"expires_after": "3600"}, "expires_after"),
])
def test_a_bad_expires_after_is_a_400_naming_the_parameter(api_server, fields, param):
    acme = make_tenant_key("acme")
    answer = upload(api_server, acme.key, jsonl(chat_line("a", "m")), **fields)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert File.objects.count() == 0


def test_an_expired_file_reads_as_unknown_and_the_beat_deletes_it(api_server, served_model):
    acme = make_tenant_key("acme")
    client = client_for(api_server, acme.key)
    source = client.files.create(file=("in.jsonl", jsonl(chat_line("a", served_model))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch_services.batch_expand(batch_id=batch.id)  # the batch has read its file
    fresh = client.files.create(file=("in.jsonl", jsonl(chat_line("b", served_model))),
                                purpose="batch")
    File.objects.filter(pk=source.id).update(expires_at=timezone.now())
    for call in (lambda: client.files.retrieve(source.id),
                 lambda: client.files.content(source.id),
                 lambda: client.batches.create(input_file_id=source.id,
                                               endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [f.id for f in client.files.list()] == [fresh.id]
    assert len(stored_names()) == 2  # not yet deleted: it only reads as gone
    assert batch_services.files_expire() == 1
    assert not File.objects.filter(pk=source.id).exists()
    assert stored_names() == [File.objects.get(pk=fresh.id).storage_name]
    assert client.batches.retrieve(batch.id).input_file_id == source.id


def test_a_file_a_batch_has_not_read_is_kept_until_it_has(api_server, served_model):
    client = client_for(api_server, make_tenant_key("acme").key)
    source = client.files.create(file=("in.jsonl", jsonl(chat_line("a", served_model))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    with pytest.raises(openai.ConflictError):
        client.files.delete(source.id)
    File.objects.filter(pk=source.id).update(expires_at=timezone.now())
    assert batch_services.files_expire() == 0
    assert batch_services.batch_expand(batch_id=batch.id).status == "in_progress"
    assert batch_services.files_expire() == 1


# --- batches don't read the file in the web request ----------------------------------------

def test_a_batch_is_made_without_reading_its_file_and_one_that_cannot_be_read_fails(
        api_server, served_model):
    client = client_for(api_server, make_tenant_key("acme").key)
    source = client.files.create(file=("in.jsonl", jsonl(
        chat_line("a", served_model), chat_line("b", served_model))), purpose="batch")
    files_storage().delete(File.objects.get(pk=source.id).storage_name)  # its bytes gone
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert (batch.status, batch.request_counts.total) == ("validating", 2)
    assert BatchLine.objects.filter(batch_id=batch.id).count() == 0
    failed = batch_services.batch_expand(batch_id=batch.id)
    assert failed.status == "failed" and failed.failed_at is not None
    (error,) = client.batches.retrieve(batch.id).errors.data
    assert (error.code, error.param) == ("file_not_found", "input_file_id")


def test_a_batch_whose_lines_call_another_endpoint_is_refused_naming_the_line(api_server):
    client = client_for(api_server, make_tenant_key("acme").key)
    mixed = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": "Hi"}}
    source = client.files.create(file=("in.jsonl", jsonl(
        chat_line("a", "m"), chat_line("b", "m"), mixed)), purpose="batch")
    for endpoint, says in (("/v1/chat/completions", "line 3 calls /v1/completions"),
                           ("/v1/completions", "line 1 calls /v1/chat/completions")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=source.id, endpoint=endpoint,
                                  completion_window="24h")
        assert says in refused.value.message
    assert Batch.objects.count() == 0


def test_expansion_resumes_where_a_dead_runner_left_it(api_server, served_model):
    client = client_for(api_server, make_tenant_key("acme").key)
    source = client.files.create(file=("in.jsonl", jsonl(
        *(chat_line(f"r{i}", served_model) for i in range(5)))), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    # A runner died after its first slice: lines 0 and 1 made, the batch still validating.
    BatchLine.objects.bulk_create([BatchLine(batch_id=batch.id, index=i, custom_id=f"r{i}",
                                             body={"model": served_model}) for i in (0, 1)])
    assert batch_services.batch_expand(batch_id=batch.id).status == "in_progress"
    assert batch_services.batch_expand(batch_id=batch.id).status == "in_progress"  # again
    lines = BatchLine.objects.filter(batch_id=batch.id).order_by("index")
    assert [(line.index, line.custom_id) for line in lines] == [(i, f"r{i}") for i in range(5)]
    assert lines[4].body["messages"][0]["content"] == "Say r4"


# --- limits --------------------------------------------------------------------------------

def _plan_of(tenant_id: int) -> Plan:
    return Tenant.objects.select_related("plan").get(pk=tenant_id).plan


def test_a_tenant_past_its_plans_file_count_is_refused_and_others_are_not(api_server,
                                                                           settings):
    settings.ATRIUM_TENANT_MAX_FILES = 100
    acme, globex = make_tenant_key("acme"), make_tenant_key("globex")
    small = Plan.objects.create(slug="small", name="Small", requests_per_minute=10,
                                tokens_per_minute=1000, max_concurrent_requests=1, max_files=2)
    Tenant.objects.filter(pk=acme.tenant_id).update(plan=small)
    data = jsonl(chat_line("a", "m"))
    assert [upload(api_server, acme.key, data).status_code for _ in range(2)] == [200, 200]
    refused = upload(api_server, acme.key, data)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "file_limit_exceeded"
    assert upload(api_server, globex.key, data).status_code == 200  # the server's 100
    assert File.objects.filter(tenant_id=acme.tenant_id).count() == 2
    assert len(stored_names()) == 3


def test_a_tenant_past_its_storage_bytes_is_refused(api_server, settings):
    acme = make_tenant_key("acme")
    data = jsonl(chat_line("a", "m"))
    settings.ATRIUM_TENANT_MAX_FILE_BYTES = len(data) * 2 + 1
    assert upload(api_server, acme.key, data).status_code == 200
    assert upload(api_server, acme.key, data).status_code == 200
    refused = upload(api_server, acme.key, data)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "storage_limit_exceeded"
    File.objects.filter(tenant_id=acme.tenant_id).update(expires_at=timezone.now())
    assert upload(api_server, acme.key, data).status_code == 200  # expired ones don't count


def test_concurrent_uploads_never_pass_the_file_limit(transactional_db, settings):
    from django.db import connection

    settings.ATRIUM_TENANT_MAX_FILES = 3
    tenant = Tenant.objects.get(pk=make_tenant_key("acme").tenant_id)
    start = threading.Barrier(8)
    outcomes: list[str] = []

    def send() -> None:
        start.wait()
        try:
            batch_services.file_create(tenant_id=tenant.pk, filename="in.jsonl",
                                       purpose="batch", data=jsonl(chat_line("a", "m")))
            outcomes.append("stored")
        except ApiError as exc:
            outcomes.append(exc.code)
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["file_limit_exceeded"] * 5 + ["stored"] * 3
    assert File.objects.count() == 3 and len(stored_names()) == 3


def test_a_tenant_past_its_active_batches_gets_a_429(api_server, settings):
    settings.ATRIUM_TENANT_MAX_ACTIVE_BATCHES = 2
    client = client_for(api_server, make_tenant_key("acme").key)
    source = client.files.create(file=("in.jsonl", jsonl(chat_line("a", "m"))),
                                 purpose="batch")

    def create():
        return client.batches.create(input_file_id=source.id,
                                     endpoint="/v1/chat/completions", completion_window="24h")

    first, _ = create(), create()
    with pytest.raises(openai.RateLimitError) as refused:
        create()
    assert refused.value.code == "batch_limit_exceeded"
    assert refused.value.response.headers["x-should-retry"] == "false"
    client.batches.cancel(first.id)  # cancelling: still not ended
    with pytest.raises(openai.RateLimitError):
        create()
    Batch.objects.filter(pk=first.id).update(status="cancelled")
    assert create().status == "validating"


def test_a_tenant_runs_no_more_batches_at_once_than_its_share(api_server, settings,
                                                               monkeypatch):
    settings.ATRIUM_BATCH_TENANT_RUNNING = 2
    acme, globex = make_tenant_key("acme"), make_tenant_key("globex")
    ids = {}
    for who in (acme, globex):
        client = client_for(api_server, who.key)
        source = client.files.create(file=("in.jsonl", jsonl(chat_line("a", "m"))),
                                     purpose="batch")
        ids[who.slug] = [client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions",
            completion_window="24h").id for _ in range(3)]
    first, second, third = ids["acme"]
    assert batch_services.batch_claim(batch_id=first) is not None
    assert batch_services.batch_claim(batch_id=second) is not None
    assert batch_services.batch_claim(batch_id=third) is None  # waits: acme runs two
    assert batch_services.batch_claim(batch_id=ids["globex"][0]) is not None
    Batch.objects.filter(pk=first).update(runner_lease_until=timezone.now()
                                          - timedelta(seconds=1))  # its runner died
    queued: list[str] = []
    monkeypatch.setattr("batches.services.running.batch_run_enqueue",
                        lambda batch_id: queued.append(batch_id))
    # acme runs one now and may run two: its oldest waiting one is queued, not all of them;
    # globex likewise has room for one more.
    assert batch_services.batches_resume() == 2
    assert sorted(queued) == sorted([first, ids["globex"][1]])
    assert batch_services.batch_claim(batch_id=third) is not None


# --- the upload holds up nothing else ------------------------------------------------------

class GatedStorage(FileSystemStorage):
    """Holds every save until the test lets it go."""

    entered = threading.Event()
    release = threading.Event()

    def _save(self, name, content):
        type(self).entered.set()
        assert type(self).release.wait(60)
        return super()._save(name, content)


@pytest.fixture
def gated_storage(files_dir, settings) -> type[GatedStorage]:
    settings.STORAGES = {**settings.STORAGES, "atrium-files": {
        "BACKEND": f"{__name__}.GatedStorage", "OPTIONS": {"location": str(files_dir)}}}
    storages._storages.pop("atrium-files", None)
    storages.backends = settings.STORAGES
    GatedStorage.entered.clear()
    GatedStorage.release.clear()
    yield GatedStorage
    GatedStorage.release.set()


def test_an_upload_in_progress_holds_up_no_inference_request(api_server, gated_storage):
    uploader, other = make_tenant_key("acme"), make_tenant_key("globex")
    answers: list[httpx.Response] = []
    sending = threading.Thread(target=lambda: answers.append(
        upload(api_server, uploader.key, jsonl(chat_line("a", "m")))))
    sending.start()
    try:
        assert GatedStorage.entered.wait(30), "the upload never reached its storage"
        began = time.monotonic()
        models = httpx.get(f"{api_server}/v1/models", timeout=10,
                           headers={"Authorization": f"Bearer {other.key}"})
        assert models.status_code == 200
        assert time.monotonic() - began < 5
        assert sending.is_alive() and not answers  # the upload is still held
    finally:
        GatedStorage.release.set()
        sending.join(timeout=30)
    assert answers[0].status_code == 200
    assert json.loads(answers[0].text)["object"] == "file"


def test_a_tenants_uploads_take_turns_while_another_tenants_go_beside(api_server,
                                                                     gated_storage):
    acme, globex = make_tenant_key("acme"), make_tenant_key("globex")
    answers: dict[str, httpx.Response] = {}

    def send(name: str, key: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(
            name, upload(api_server, key, jsonl(chat_line(name, "m")))))
        thread.start()
        return thread

    first = send("first", acme.key)
    try:
        assert GatedStorage.entered.wait(30), "the first upload never reached its storage"
        GatedStorage.entered.clear()
        second = send("second", acme.key)  # the same tenant's: waits for its turn
        time.sleep(1)  # time enough to reach its storage, were it not waiting
        assert not GatedStorage.entered.is_set(), "the same tenant's upload did not wait"
        theirs = send("theirs", globex.key)  # another tenant's: reaches storage meanwhile
        assert GatedStorage.entered.wait(30), "another tenant's upload waited"
        assert "second" not in answers and second.is_alive()
    finally:
        GatedStorage.release.set()
        for thread in (first, theirs, second):
            thread.join(timeout=30)
    assert {name: reply.status_code for name, reply in answers.items()} == {
        "first": 200, "second": 200, "theirs": 200}

