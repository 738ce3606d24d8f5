"""Load test for `treeflash serve`, on loopback only, bounded in requests and seconds.

Starts a server (or connects to one with --url), computes the plain-decoding (AR) answer of every prompt here, in
process, with `engine.generate` and the ar drafter, then runs rounds of requests from --clients concurrent clients:
streamed and not, some leaving early. Every answer that was neither rejected (429) nor abandoned must be complete
and equal its AR answer (T = 0). Reports latency percentiles, throughput, 429s, the server's RSS after each round
(did memory grow?), and, for a server it started, whether SIGTERM lets the request in flight finish.

    python scripts/load_test.py --requests 96 --rounds 3 --out load.json
    python scripts/load_test.py --clients 8 --max-batch 8 --out load-batched.json   # continuous batching
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx
import psutil

from treeflash.serve.app import is_loopback

PROMPTS = [
    "Name three prime numbers and say why each is prime.",
    "Explain in two sentences what a hash table is.",
    "Write a Python function that reverses a string.",
    "Tom has 12 marbles and gives away 5. How many are left?",
    "What is the capital of France? Answer briefly.",
    "List four colours of the rainbow.",
    "Write a haiku about the sea.",
    "Why is the sky blue? One paragraph.",
]


@dataclass
class Outcome:
    status: str  # ok, mismatch, incomplete, left (the client disconnected on purpose), failed
    latency_s: float = 0.0  # of the attempt that was served, queueing in the server included
    first_token_s: float | None = None  # streamed answers
    tokens: int = 0
    rejected: int = 0  # 429s before it was served
    detail: str = ""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)  # the server's, after each round
    seconds: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "treeflash.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--target", args.target, "--dtype", args.dtype, "--max-queue", str(args.max_queue),
           "--max-batch", str(args.max_batch)]
    if args.method:
        cmd += ["--method", args.method]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TREEFLASH_API_KEY": ""})


def wait_healthy(url: str, seconds: float, server: subprocess.Popen | None) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server and server.poll() is not None:
            sys.exit(f"load_test: the server exited with status {server.returncode} (see its log)")
        try:
            return httpx.get(url + "/health", timeout=2).json()
        except httpx.HTTPError:
            time.sleep(0.5)
    sys.exit(f"load_test: no server answered at {url} within {seconds:.0f} s")


def references(args) -> list[str]:
    """Plain decoding of every prompt, as `treeflash generate --method ar` decodes it."""
    from treeflash.drafters import make_drafter
    from treeflash.engine import generate
    from treeflash.runtime import Target

    target = Target.load(args.target, dtype=args.dtype)
    return [target.decode(generate(target, make_drafter("ar"), target.encode_prompt(p), args.max_tokens).tokens)
            for p in PROMPTS]


async def one_request(http: httpx.AsyncClient, i: int, args, model: str, expected: list[str], deadline: float
                      ) -> Outcome:
    """Request i: prompt i % 8, streamed when i is odd, abandoned after two chunks when i % 8 == 5."""
    stream, leave = i % 2 == 1, i % 8 == 5
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": args.max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    want, rejected = expected[i % len(PROMPTS)], 0
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            if not stream:
                answer = await http.post("/v1/chat/completions", json=body)
                if answer.status_code == 429:
                    rejected += 1
                    await asyncio.sleep(float(answer.headers.get("retry-after", 1)))
                    continue
                if answer.status_code != 200:
                    return Outcome("failed", rejected=rejected, detail=f"{answer.status_code}: {answer.text[:200]}")
                data = answer.json()
                choice = data["choices"][0]
                return _judge(choice["message"]["content"], choice["finish_reason"], data["usage"], want,
                              time.monotonic() - start, None, rejected)
            async with http.stream("POST", "/v1/chat/completions", json=body) as events:
                if events.status_code == 429:
                    rejected += 1
                    await asyncio.sleep(float(events.headers.get("retry-after", 1)))
                    continue
                if events.status_code != 200:
                    return Outcome("failed", rejected=rejected, detail=f"{events.status_code}")
                text, finish, usage, first, chunks, done = "", None, None, None, 0, False
                async for line in events.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk, chunks = json.loads(line[6:]), chunks + 1
                    if "error" in chunk:
                        return Outcome("failed", rejected=rejected, detail=chunk["error"]["message"])
                    if leave and chunks == 2:
                        return Outcome("left", time.monotonic() - start, rejected=rejected)
                    usage = chunk.get("usage") or usage
                    for c in chunk["choices"]:
                        if c["delta"].get("content") and first is None:
                            first = time.monotonic() - start
                        text += c["delta"].get("content") or ""
                        finish = c["finish_reason"] or finish
                if not done:
                    return Outcome("incomplete", rejected=rejected, detail="no [DONE]")
                return _judge(text, finish, usage, want, time.monotonic() - start, first, rejected)
        except httpx.HTTPError as err:
            return Outcome("failed", rejected=rejected, detail=repr(err))
    return Outcome("failed", rejected=rejected, detail="out of time (--seconds)")


def _judge(text: str, finish: str | None, usage: dict | None, want: str, latency: float, first: float | None,
           rejected: int) -> Outcome:
    tokens = (usage or {}).get("completion_tokens", 0)
    if finish not in ("stop", "length") or not usage:
        return Outcome("incomplete", latency, first, tokens, rejected, f"finish_reason {finish}, usage {usage}")
    if text != want:
        return Outcome("mismatch", latency, first, tokens, rejected, f"{text[:60]!r} != {want[:60]!r}")
    return Outcome("ok", latency, first, tokens, rejected)


async def run_load(url: str, args, model: str, expected: list[str], pid: int | None) -> Report:
    report, deadline = Report(), time.monotonic() + args.seconds
    limits = httpx.Limits(max_connections=args.clients)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=args.seconds, limits=limits) as http:
        per_round = -(-args.requests // args.rounds)
        for r in range(args.rounds):
            todo = list(range(r * per_round, min((r + 1) * per_round, args.requests)))

            async def client() -> None:
                while todo and time.monotonic() < deadline:
                    report.outcomes.append(await one_request(http, todo.pop(0), args, model, expected, deadline))

            await asyncio.gather(*(client() for _ in range(args.clients)))
            if pid:
                report.rss_mb.append(psutil.Process(pid).memory_info().rss / 2**20)
            print(f"round {r + 1}/{args.rounds}: {len(report.outcomes)} requests done", file=sys.stderr)
    report.seconds = time.monotonic() - start
    return report


def sigterm_check(url: str, model: str, server: subprocess.Popen) -> dict:
    """SIGTERM while a streamed request runs: the request must still finish, then the server exit."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as events:
        lines = events.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.send_signal(signal.SIGTERM)
        finished = any(line == "data: [DONE]" for line in lines)
    try:
        code = server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()
        code = None
    # uvicorn raises the signal again once its graceful shutdown is done: -SIGTERM is a clean exit
    return {"request_finished": finished, "exit_code": code, "clean_exit": code in (0, -signal.SIGTERM)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summarise(report: Report, args, shutdown: dict | None) -> dict:
    outcomes = report.outcomes
    count = {s: sum(o.status == s for o in outcomes) for s in ("ok", "mismatch", "incomplete", "left", "failed")}
    served = [o for o in outcomes if o.status in ("ok", "mismatch")]
    latencies = [o.latency_s for o in served]
    firsts = [o.first_token_s for o in served if o.first_token_s is not None]
    tokens = sum(o.tokens for o in served)
    rss = report.rss_mb
    growth = rss[-1] - rss[0] if len(rss) > 1 else None  # after round 1: warm-up allocations are done
    return {
        "clients": args.clients, "requests": len(outcomes), "max_tokens": args.max_tokens, "rounds": args.rounds,
        **count, "rejected_429": sum(o.rejected for o in outcomes),
        "latency_s": {f"p{q}": percentile(latencies, q) for q in (50, 90, 99)},
        "first_token_s": {f"p{q}": percentile(firsts, q) for q in (50, 90, 99)},
        "tokens": tokens, "seconds": report.seconds, "tokens_per_second": tokens / report.seconds,
        "rss_mb": rss, "rss_growth_mb": growth,
        "memory_grew": None if growth is None else growth > max(50.0, 0.05 * rss[0]),
        "shutdown": shutdown,
        "problems": [asdict(o) for o in outcomes if o.status in ("mismatch", "incomplete", "failed")][:5],
    }


def table(s: dict) -> str:
    def ms(d: dict) -> str:
        return "  ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in d.items())

    rows = [
        ("requests", f"{s['requests']} from {s['clients']} clients in {s['rounds']} rounds, {s['max_tokens']} "
                     "tokens max"),
        ("answers", f"ok {s['ok']}  mismatch {s['mismatch']}  incomplete {s['incomplete']}  failed {s['failed']}  "
                    f"left early {s['left']}"),
        ("429s", f"{s['rejected_429']} (each retried after Retry-After)"),
        ("latency s", ms(s["latency_s"]) + "   (served attempt, queueing included)"),
        ("first token s", ms(s["first_token_s"]) + "   (streamed)"),
        ("throughput", f"{s['tokens_per_second']:.1f} tokens/s ({s['tokens']} tokens in {s['seconds']:.1f} s)"),
        ("server RSS MB", " -> ".join(f"{x:.0f}" for x in s["rss_mb"]) or "-"),
        ("memory grew", "-" if s["memory_grew"] is None else
         f"{'yes' if s['memory_grew'] else 'no'} ({s['rss_growth_mb']:+.0f} MB from round 1 to the last)"),
    ]
    if s["shutdown"]:
        rows.append(("SIGTERM", f"request in flight finished: {s['shutdown']['request_finished']}, clean exit: "
                                f"{s['shutdown']['clean_exit']} (status {s['shutdown']['exit_code']})"))
    return "\n".join(f"{k:<14} {v}" for k, v in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server on loopback (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process, for its RSS")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--method", default=None, help="for the server it starts (default: serve's default)")
    p.add_argument("--max-queue", type=int, default=16, help="for the server it starts")
    p.add_argument("--max-batch", type=int, default=1, help="for the server it starts: requests decoded together")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=96, help="in all (at most 2000)")
    p.add_argument("--rounds", type=int, default=3, help="the server's RSS is sampled after each")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seconds", type=float, default=600, help="the load stops after this (at most 3600)")
    p.add_argument("--out", default=None, help="write the summary as JSON")
    args = p.parse_args()
    if not (0 < args.requests <= 2000 and 0 < args.seconds <= 3600 and 0 < args.clients <= 256
            and 0 < args.rounds <= args.requests):
        p.error("keep it bounded: 0 < --requests <= 2000, --seconds <= 3600, --clients <= 256, --rounds <= requests")
    if args.requests < args.clients * args.rounds:
        print(f"load_test: note: {args.requests // args.rounds} requests a round keep at most that many of the "
              f"{args.clients} clients busy", file=sys.stderr)
    if args.url and not is_loopback(urlparse(args.url).hostname or ""):
        p.error(f"{args.url} is not a loopback address: this script only loads a server on this machine")

    print("load_test: AR references, in process ...", file=sys.stderr)
    expected = references(args)
    server, log, pid, url = None, None, args.pid, args.url
    if not url:
        port = free_port()
        log = tempfile.NamedTemporaryFile("w", prefix="treeflash-serve-", suffix=".log", delete=False)
        server, url, pid = (s := start_server(args, port, log)), f"http://127.0.0.1:{port}", s.pid
        print(f"load_test: server pid {pid} on {url}, log {log.name}", file=sys.stderr)
    try:
        health = wait_healthy(url, 600, server)
        report = asyncio.run(run_load(url.rstrip("/"), args, health["model"], expected, pid))
        shutdown = sigterm_check(url, health["model"], server) if server else None
    finally:
        if server and server.poll() is None:
            server.kill()
    summary = {"url": url, "method": health["method"], "model": health["model"],
               "max_batch": None if args.url else args.max_batch,
               **summarise(report, args, shutdown)}
    print(f"method {summary['method']}, model {summary['model']}, max batch {summary['max_batch']}, "
          f"{args.clients} clients, T = 0, every served answer checked against AR")
    print(table(summary))
    for problem in summary["problems"]:
        print("problem:", problem)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    clean = not shutdown or (shutdown["request_finished"] and shutdown["clean_exit"])
    return 0 if summary["mismatch"] == summary["incomplete"] == summary["failed"] == 0 and clean else 1


if __name__ == "__main__":
    sys.exit(main())
