"""`atrium up` started, stopped and started again on one home, as a user's laptop sees it."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

from engine.options import threads_each
from tests.e2e.conftest import (
    BIN,
    ROOT,
    Atrium,
    _fill_model_cache,
    _seed_model_cache,
    free_port,
    user_env,
)


def _fresh(tmp_path: Path) -> Atrium:
    home = tmp_path / "home"
    home.mkdir()
    _seed_model_cache(home)
    return Atrium(setup="embedded", home=home, env=user_env(home), port=free_port())


def _run_example(up: Atrium, pattern: str) -> subprocess.CompletedProcess:
    example = re.search(pattern, up.output, re.S | re.M).group(1)
    return subprocess.run(["bash", "-c", example], capture_output=True, text=True, timeout=120,
                          env=up.env, cwd=up.home)


def test_the_demo_key_is_made_once_and_a_restart_says_how_to_get_another(tmp_path):
    up = _fresh(tmp_path)
    try:
        up.start()
        _fill_model_cache(up.home)  # when this start built the model, later homes copy it
        first_key = up.key
        assert first_key
        # The banner's own examples run as printed.
        curl = _run_example(up, r"^(curl -N .*?)\n\n")
        events = [line for line in curl.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", curl.stdout + curl.stderr
        python = _run_example(up, r"^(python - <<'PY'\n.*?\nPY)$")
        assert python.returncode == 0 and python.stdout.strip(), python.stderr
        assert "word salad" in up.output and "ATRIUM_MODEL=/path/to/model" in up.output
        # Its two engines (the demo chat and embedding models) split the machine's cores.
        threads = re.findall(r'"msg": "engine on cpu with (\d+) torch threads"', up.output)
        assert threads == [str(threads_each(2))] * 2, up.output[-3000:]
        # The server's own address stays readable in its log lines (not user data).
        assert re.search(rf'"msg": "Uvicorn running on http://127\.0\.0\.1:{up.port}',
                         up.output), up.output[-3000:]
        socket_path = re.search(r"embedded Redis at unix://(\S+)", up.output).group(1)
        assert up.stop() == 0, up.output[-3000:]
        assert not Path(socket_path).exists(), "the embedded Redis server was left running"
        print(f"first start {up.started_s:.1f}s")

        up.start()
        assert up.key == first_key  # nothing new was shown
        assert "API key" not in up.output.split("Atrium is up")[1].split("\n")[2]
        assert "atrium create-key demo --scopes inference,adapters,usage,billing" in up.output
        assert "atrium up --new-key" in up.output
        reply = up.openai(first_key).chat.completions.create(
            model=up.model, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens > 0
        print(f"warm start {up.started_s:.1f}s")
        assert up.stop() == 0, up.output[-3000:]

        up.key = ""
        up.start("--new-key")
        assert up.key and up.key != first_key
    finally:
        up.stop()


def test_a_busy_port_is_one_line_that_names_a_free_one(tmp_path):
    up = _fresh(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, env in ((["--port", str(port)], {}), ([], {"ATRIUM_PORT": str(port)})):
            result = subprocess.run([str(BIN / "atrium"), "up", *args], env={**up.env, **env},
                                    capture_output=True, text=True, timeout=60)
            assert result.returncode != 0
            assert result.stdout == ""
            line = result.stderr.strip()
            assert re.fullmatch(rf"atrium: port {port} is in use; try `make up PORT=\d+`", line)
            suggested = int(re.search(r"PORT=(\d+)", line).group(1))
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", suggested))  # it is free
    assert not (up.home / "redis.url").exists()  # nothing was started


def test_a_busy_metrics_port_is_one_line_too(tmp_path):
    up = _fresh(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", up.metrics_port + 1))  # the engine's
        taken.listen()
        result = subprocess.run([str(BIN / "atrium"), "up", "--port", str(up.port),
                                 "--metrics-port", str(up.metrics_port)], env=up.env,
                                capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and result.stdout == ""
    assert re.fullmatch(rf"atrium: port {up.metrics_port + 1} is in use; try "
                        r"`atrium up --metrics-port \d+`", result.stderr.strip()), result.stderr
    assert not (up.home / "redis.url").exists()  # nothing was started


def test_make_up_passes_the_port():
    dry = subprocess.run(["make", "-n", "up", "PORT=9123"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"atrium up --port 9123$", dry.stdout, re.M), dry.stdout


def test_a_broker_other_than_redis_stops_atrium_up_with_one_line(tmp_path):
    home = tmp_path / "home"  # no demo model: the refusal comes before a minute of training
    home.mkdir()
    up = Atrium(setup="embedded", home=home, env=user_env(home), port=free_port())
    result = subprocess.run([str(BIN / "atrium"), "up", "--port", str(up.port),
                             "--metrics-port", str(up.metrics_port)],
                            env={**up.env, "CELERY_BROKER_URL": "amqp://guest@localhost:5672"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "atrium: Celery must use the platform's Redis" in result.stderr
    assert "Traceback" not in result.stderr
    assert "building the demo model" not in result.stdout
    assert not (home / "models").exists()
