"""Service tiers and token-fair scheduling under overload (issue 39): bench/results/tiers.json.

The real engine (engine/llm_engine.py) on the demo checkpoint, every answer run to its
max_tokens (ignore_eos: the trained demo model would stop early), driven open-loop in one
process: Poisson arrivals are added as their time comes, one engine step after another,
and a request's TTFT runs from its arrival time to the step that gave its first token. No
Redis and no web tier: what is measured is the scheduler. (The lanes that keep a priority
request from queueing in Redis behind default ones are tested in
tests/inference/test_service_tiers.py; a web tier on the same 2 cores would measure itself.)

Peer, in the same run: the same engine with tiers and token fairness off, as the scheduler
was before issue 39: every request in the default tier, tenants taking turns by request
(``fair_share="requests"``).

Phases (C: the sustainable rate, measured first: a standard request kept in every seat),
after a warm-up of each engine (its first steps of each shape are several times slower):
- idle: priority requests alone at 0.1 C: their p99 TTFT on an idle engine;
- overload: 2 C, one request in ten priority: ``priority_p99_vs_idle``;
- noisy: four tenants; three quiet ones send standard requests at half their share
  (C/8 each), the fourth prompts 8 times as long at ten times its share of tokens; each
  tenant has at most 32 requests in flight (admission's concurrency limit; past it a
  request is refused, as the web tier would). ``noisy_tenant_p99_increase``: the quiet
  tenants' p99 TTFT beside the noisy one over theirs alone;
- flex: default requests at 0.7 C, alone and with a flex flood at 1.5 C (the peer: the
  flood in the default tier): ``throughput_ratio_with_flex`` (tokens/s, ours over the
  peer's) and ``default_p99_with_flex_vs_without``.

    .venv/bin/python bench/tiers.py [--window 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
from bench.workload import percentile  # noqa: E402
from engine import protocol  # noqa: E402

PROMPT, OUTPUT, NOISY_PROMPT = 64, 32, 512
CONCURRENCY_LIMIT = 32  # per tenant, as admission's max_concurrent_requests
DRAIN_S = 90.0  # after the window, the longest the measured requests are waited for
_ids = itertools.count()


@dataclass
class Arrival:
    at: float  # seconds after the phase's start
    tenant: str
    tier: str
    prompt_len: int
    measured: bool  # its TTFT is reported (else it is load)


@dataclass
class Phase:
    ttft: dict[str, list[float]] = field(default_factory=dict)  # by group: tenant or tier
    tokens: int = 0  # output tokens made within the window
    refused: int = 0
    unstarted: int = 0  # measured requests with no first token by the drain's end
    window_s: float = 0.0


def poisson(rate: float, window: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= window:
            return times
        times.append(t)
    return times


def engine_for(model_dir: Path, *, ours: bool):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=model_dir,
                                  fair_share="tokens" if ours else "requests"))


def request(engine, arrival: Arrival, rng: random.Random, *, ours: bool):
    vocab = engine.vocab_size
    rid = f"r{next(_ids)}"
    return protocol.EngineRequest(
        request_id=rid, model="demo", tenant_id=arrival.tenant, cache_salt=arrival.tenant,
        prompt_token_ids=[rng.randrange(10, vocab) for _ in range(arrival.prompt_len)],
        sampling=protocol.SamplingSpec(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True),
        service_tier=arrival.tier if ours else protocol.TIER_DEFAULT)


def run_phase(engine, arrivals: list[Arrival], window: float, *, ours: bool,
              group: str = "tier") -> Phase:
    """Runs ``arrivals`` open-loop; each measured request's TTFT, grouped by ``group``."""
    rng = random.Random(7)
    arrivals = sorted(arrivals, key=lambda a: a.at)
    phase, pending = Phase(window_s=window), list(reversed(arrivals))
    open_by: dict[str, tuple[Arrival, float]] = {}  # request id -> (arrival, its time)
    in_flight: dict[str, int] = {}
    first_seen: set[str] = set()
    start = time.monotonic()
    while True:
        now = time.monotonic() - start
        while pending and pending[-1].at <= now:
            arrival = pending.pop()
            if in_flight.get(arrival.tenant, 0) >= CONCURRENCY_LIMIT:
                phase.refused += 1
                continue
            req = request(engine, arrival, rng, ours=ours)
            engine.add_request(req)
            open_by[req.request_id] = (arrival, start + arrival.at)
            in_flight[arrival.tenant] = in_flight.get(arrival.tenant, 0) + 1
        measured_open = [r for r, (a, _) in open_by.items() if a.measured and r not in first_seen]
        if now >= window and (not measured_open or now >= window + DRAIN_S):
            phase.unstarted = len(measured_open)
            break
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        outputs = engine.step()
        stamp = time.monotonic()
        for out in outputs:
            arrival, arrived = open_by[out.request_id]
            if out.token_ids and out.request_id not in first_seen:
                first_seen.add(out.request_id)
                if arrival.measured:
                    key = arrival.tenant if group == "tenant" else arrival.tier
                    phase.ttft.setdefault(key, []).append(stamp - arrived)
            if stamp - start <= window:
                phase.tokens += len(out.token_ids)
            if out.finished:
                in_flight[arrival.tenant] -= 1
                del open_by[out.request_id]
    for rid in list(open_by):
        engine.abort_request(rid, protocol.FINISH_CANCELLED)
    return phase


def capacity(engine, window: float, in_flight: int) -> float:
    """Requests a second with ``in_flight`` standard requests kept in flight."""
    rng = random.Random(3)
    start, done = time.monotonic(), 0
    arrival = Arrival(0, "t0", protocol.TIER_DEFAULT, PROMPT, False)
    for _ in range(in_flight):
        engine.add_request(request(engine, arrival, rng, ours=True))
    while time.monotonic() - start < window:
        for out in engine.step():
            if out.finished:
                done += 1
                engine.add_request(request(engine, arrival, rng, ours=True))
    elapsed = time.monotonic() - start
    while engine.has_unfinished():
        engine.step()
    return done / elapsed


def p99s(phase: Phase) -> dict[str, float]:
    return {k: round(percentile(v, 99), 4) for k, v in sorted(phase.ttft.items())}


def summary(phase: Phase) -> dict:
    return {"ttft_p50_s": {k: round(percentile(v, 50), 4) for k, v in sorted(phase.ttft.items())},
            "ttft_p99_s": p99s(phase), "requests": {k: len(v) for k, v in phase.ttft.items()},
            "output_tokens_per_s": round(phase.tokens / phase.window_s, 1),
            "refused": phase.refused, "unstarted_after_drain": phase.unstarted}


def one_round(ours_engine, peer_engine, cap: float, window: float, seed: int) -> dict:
    """Every phase once, ours and the peer's back to back; the round's figures."""
    rng = random.Random(seed)
    P, D, F = protocol.TIER_PRIORITY, protocol.TIER_DEFAULT, protocol.TIER_FLEX
    out: dict = {}

    def phase(name: str, engine, arrivals: list[Arrival], ours: bool, group: str = "tier"):
        out[name] = summary(run_phase(engine, arrivals, window, ours=ours, group=group))
        print(name, out[name], flush=True)

    phase("idle", ours_engine, [Arrival(t, "p0", P, PROMPT, True)
                                for t in poisson(0.1 * cap, window, rng)], True)
    overload = ([Arrival(t, f"t{i % 4}", D, PROMPT, False)
                 for i, t in enumerate(poisson(1.8 * cap, window, rng))]
                + [Arrival(t, "p0", P, PROMPT, True) for t in poisson(0.2 * cap, window, rng)])
    phase("overload", ours_engine, overload, True)
    phase("overload_peer", peer_engine, overload, False)
    quiet = [Arrival(t, f"q{i}", D, PROMPT, True)
             for i in range(3) for t in poisson(cap / 8, window, rng)]
    # Ten times its share (C/4 requests of PROMPT tokens) in tokens: 2.5 C standard
    # requests' worth, in prompts NOISY_PROMPT long.
    noisy_rate = 2.5 * cap * (PROMPT + 2 * OUTPUT) / (NOISY_PROMPT + 2 * OUTPUT)
    noisy = [Arrival(t, "noisy", D, NOISY_PROMPT, False)
             for t in poisson(noisy_rate, window, rng)]
    phase("quiet_alone", ours_engine, quiet, True, "tenant")
    phase("quiet_alone_peer", peer_engine, quiet, False, "tenant")
    phase("noisy", ours_engine, quiet + noisy, True, "tenant")
    phase("noisy_peer", peer_engine, quiet + noisy, False, "tenant")
    default = [Arrival(t, f"t{i % 4}", D, PROMPT, True)
               for i, t in enumerate(poisson(0.7 * cap, window, rng))]
    flood = [Arrival(t, f"f{i % 4}", F, PROMPT, False)
             for i, t in enumerate(poisson(1.5 * cap, window, rng))]
    phase("default_alone", ours_engine, default, True)
    phase("with_flex", ours_engine, default + flood, True)
    phase("with_flex_peer", peer_engine, default + flood, False)

    def quiet_p99(name: str) -> float:
        return max(out[name]["ttft_p99_s"].values())

    out["priority_p99_vs_idle"] = round(
        out["overload"]["ttft_p99_s"][P] / out["idle"]["ttft_p99_s"][P], 3)
    out["priority_p99_vs_idle_peer"] = round(
        out["overload_peer"]["ttft_p99_s"][P] / out["idle"]["ttft_p99_s"][P], 3)
    out["noisy_tenant_p99_increase"] = round(quiet_p99("noisy") / quiet_p99("quiet_alone") - 1,
                                             3)
    out["noisy_tenant_p99_increase_peer"] = round(
        quiet_p99("noisy_peer") / quiet_p99("quiet_alone_peer") - 1, 3)
    out["throughput_ratio_with_flex"] = round(
        out["with_flex"]["output_tokens_per_s"] / out["with_flex_peer"]["output_tokens_per_s"],
        3)
    out["default_p99_with_flex_vs_without"] = round(
        out["with_flex"]["ttft_p99_s"][D] / out["default_alone"]["ttft_p99_s"][D], 3)
    return out


HEADLINES = ("priority_p99_vs_idle", "priority_p99_vs_idle_peer", "noisy_tenant_p99_increase",
             "noisy_tenant_p99_increase_peer", "throughput_ratio_with_flex",
             "default_p99_with_flex_vs_without")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/tiers.json")
    args = parser.parse_args()

    import torch

    from engine.demo_model import ensure_demo_model

    torch.manual_seed(0)
    model_dir = ensure_demo_model()
    rng = random.Random(11)
    ours_engine, peer_engine = engine_for(model_dir, ours=True), engine_for(model_dir, ours=False)
    P, D = protocol.TIER_PRIORITY, protocol.TIER_DEFAULT
    # Each engine runs every shape of step once before anything is measured (its first
    # steps of a shape are several times slower): a burst, then a trickle.
    for engine, ours in ((ours_engine, True), (peer_engine, False)):
        run_phase(engine, [Arrival(t, f"t{i % 4}", P if i % 10 == 0 else D, PROMPT, False)
                           for i, t in enumerate(poisson(150.0, 5.0, rng))], 5.0, ours=ours)
        run_phase(engine, [Arrival(t, "t0", P, PROMPT, False)
                           for t in poisson(8.0, 5.0, rng)], 5.0, ours=ours)
    cap = capacity(ours_engine, 20.0, in_flight=ours_engine.config.max_num_seqs)
    print(f"capacity {cap:.2f} req/s", flush=True)
    rounds = [one_round(ours_engine, peer_engine, cap, args.window, seed=100 + r)
              for r in range(args.rounds)]
    results: dict = {"capacity_requests_per_s": round(cap, 3)}
    # The figures of record: each ratio's median over the rounds (this 2-CPU VM's rounds
    # spread by tens of percent), and every round's phases below.
    for name in HEADLINES:
        results[name] = round(statistics.median(r[name] for r in rounds), 3)
        results[f"{name}_rounds"] = [r[name] for r in rounds]
    results["rounds"] = rounds
    results["setup"] = {
        "checkpoint": "the demo checkpoint (engine/demo_model.py), ignore_eos: every answer "
                      f"{OUTPUT} tokens", "prompt_tokens": PROMPT,
        "noisy_prompt_tokens": NOISY_PROMPT, "window_s": args.window, "rounds": args.rounds,
        "per_tenant_concurrency": CONCURRENCY_LIMIT,
        "peer": "the same engine, every request in the default tier, tenants in turn by "
                "request (fair_share=requests)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip()}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in HEADLINES}, indent=2))


if __name__ == "__main__":
    main()
