"""Debian's Prometheus scrapes a running `atrium up` with the shipped rules, and every
query of the shipped Grafana dashboards is evaluated through its HTTP API: none may fail,
and the panels an operator relies on must show data."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.e2e.conftest import ROOT, Atrium, operator_console, wait_for
from tests.e2e.test_metrics import _endpoints

OBSERVABILITY = ROOT / "deploy" / "observability"
# Panels with no data until something rare happens (an export was built).
MAY_BE_EMPTY = {("atrium-billing", "Export build time")}
# Metrics read the same on either setup (tests/e2e/test_metrics.py runs both); the
# dashboards and rules are read against the one a newcomer runs.
pytestmark = pytest.mark.setups("embedded")


def _queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard uid, panel title, query) for every target of every shipped dashboard,
    with Grafana's variables as a dashboard showing everything would fill them in."""
    for path in sorted((OBSERVABILITY / "grafana").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = (target["expr"].replace("$__rate_interval", "15s")
                        .replace("$__range", "5m").replace("$model", ".*"))
                yield board["uid"], panel["title"], expr


@pytest.fixture(scope="module")
def prometheus(atrium: Atrium, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("prometheus")
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: install Debian's prometheus package (.ci/run does)")
    urls = _endpoints(atrium)
    shutil.copy(OBSERVABILITY / "prometheus" / "atrium-rules.yml", tmp_path)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["atrium-rules.yml"],
        "scrape_configs": [
            {"job_name": f"atrium-{what}", "static_configs": [
                {"targets": [url.removeprefix("http://").removesuffix("/metrics")]}]}
            for what, url in urls.items()]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = atrium.prometheus_port  # the console's ATRIUM_PROMETHEUS_URL
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def all_up() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                reply = httpx.get(f"{base}/api/v1/query", params={"query": "up"}, timeout=5)
            except httpx.HTTPError:
                return False
            results = reply.json()["data"]["result"] if reply.status_code == 200 else []
            return len(results) == 3 and all(r["value"][1] == "1" for r in results)

        wait_for(all_up, timeout=60, interval=0.5,
                 what="Prometheus to scrape the web, engine and worker")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _traffic(atrium: Atrium, stop: threading.Event) -> None:
    client = atrium.openai()
    while not stop.is_set():
        list(client.chat.completions.create(
            model=atrium.model, stream=True, max_tokens=8,
            messages=[{"role": "user", "content": "a dashboard needs data"}]))
        client.completions.create(model=atrium.model, prompt="and more", max_tokens=4)


@contextmanager
def _traffic_scraped(atrium: Atrium, prometheus: str, *needed: str) -> Iterator[None]:
    """Traffic running, and Prometheus holding ``needed`` (each with a result) from it."""
    stop = threading.Event()
    sender = threading.Thread(target=_traffic, args=(atrium, stop), daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 90
        while missing := [query for query in needed if not _result(prometheus, query)]:
            assert time.monotonic() < deadline, f"Prometheus never had: {missing}"
            time.sleep(1)
        yield
    finally:
        stop.set()
        sender.join(timeout=60)


def test_every_dashboard_query_runs_and_core_panels_show_data(atrium: Atrium, prometheus: str):
    # Enough scrapes for rates over 15 s, an ingest of the traffic's usage, and the
    # recording rules evaluated.
    with _traffic_scraped(atrium, prometheus,
                          "sum(rate(vllm:generation_tokens_total[15s])) > 0",
                          "sum(atrium_tenant_spend_total) >= 0",
                          "atrium:inference_errors:ratio_rate5m"):
        failures, empty = [], []
        for uid, title, expr in _queries():
            reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30)
            body = reply.json()
            if reply.status_code != 200 or body.get("status") != "success":
                failures.append(f"{uid} / {title}: {expr}: {body.get('error')}")
            elif not body["data"]["result"] and (uid, title) not in MAY_BE_EMPTY:
                empty.append(f"{uid} / {title}: {expr}")
        assert not failures, "\n".join(failures)
        assert not empty, "panels without data:\n" + "\n".join(empty)


def _result(base: str, query: str) -> list:
    reply = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=10)
    return reply.json()["data"]["result"] if reply.status_code == 200 else []


def _cell(html: str, row: str, field: str) -> str:
    found = re.search(rf'<tr data-(?:model|objective)="{re.escape(row)}">.*?'
                      rf'data-field="{field}">(.*?)</td>', html, re.S)
    assert found, f"no {field} for {row} in:\n{html[-4000:]}"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_the_consoles_service_health_reads_the_same_prometheus(atrium: Atrium, prometheus: str):
    with _traffic_scraped(atrium, prometheus,
                          "sum(rate(vllm:generation_tokens_total[5m])) > 0",
                          "sum(rate(vllm:inter_token_latency_seconds_count[5m])) > 0",
                          "sum(rate(atrium_inference_requests_total[30d])) > 0"):
        console = operator_console(atrium)
        page = console.get("/console/operator/health")
        console.close()
    assert page.status_code == 200
    html = page.text
    assert f"From Prometheus at <code>{prometheus}</code>" in html
    assert 'id="health-problem"' not in html
    assert _cell(html, atrium.model, "engines") == "1"
    assert re.fullmatch(r"[\d.]+ (ms|s)", _cell(html, atrium.model, "ttft"))
    assert re.fullmatch(r"[\d.]+ (ms|s)", _cell(html, atrium.model, "itl"))
    assert float(_cell(html, atrium.model, "output-tps")) > 0
    # Every request of the traffic succeeded: all the budget is left.
    assert _cell(html, "Availability", "good") == "100.000%"
    assert _cell(html, "Availability", "budget") == "100.0%"
    assert _cell(html, "Availability", "status") == "met"
