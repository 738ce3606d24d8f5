"""treeflash serve: the official openai client against a real uvicorn server on loopback.

At T = 0 every method's answer equals plain decoding (`engine.generate` with the ar drafter); stop strings cut as
OpenAI cuts them, streamed too; bad requests get OpenAI's error object, listing every problem; requests fuzzed from
the OpenAPI schema never get a 5xx; a full queue gets 429 with a Retry-After from the queue; a client that leaves
stops its generation; shutdown finishes the request in flight. Nothing waits on the wall clock: the tests wait for
events, with generous upper bounds, and deadlines run on a fake clock.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from treeflash.cli import available_methods
from treeflash.drafters import make_drafter
from treeflash.engine import GenerationResult, generate
from treeflash.serve.app import Settings, create_app
from treeflash.serve import DEFAULT_TEMPERATURE
from treeflash.serve.openai_api import APIError
from treeflash.serve.text import TextStream
from treeflash.batching import BatchEngine
from treeflash.serve.worker import BatchWorker, Job, QueueFull, Worker, engine_decoder
from treeflash.runtime import Target, resolve
from treeflash.verify import Sampling

from openapi_fuzz import operations, requests

MODEL = "smollm2-135m-instruct"
TOKENS = 24
QUESTION = "Name three prime numbers and say why each is prime."
PROMPT = "The three laws of motion are"
TARGET_LOCK = threading.Lock()  # the target holds one sequence: servers and references here take turns
WAIT_S = 30  # the most any test waits for an event that should come at once: only a broken server reaches it


@contextmanager
def running(app):
    """A uvicorn server on a free loopback port, in a thread; yields (base URL, server)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(3000):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    assert server.started, "the server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive()


def locked_engine(target, method: str = "ar"):
    engine = engine_decoder(target, make_drafter(method, target), "auto", 16)

    def decode(job):
        with TARGET_LOCK:
            return engine(job)

    return decode


def serving(target, method: str = "ar", decode=None, max_queue: int = 16, clock=time.monotonic,
            temperature: float = 0.0, **settings):
    """A running server; `decode` replaces the engine (a fake that never touches the model). Requests that name
    no temperature are greedy here, so that answers compare with plain decoding."""
    worker = Worker(decode or locked_engine(target, method), target.eos_ids, max_queue)
    settings = Settings(model=MODEL, method=method, temperature=temperature, **settings)
    return running(create_app(target, worker, settings, clock=clock))


def plain(target, prompt: list[int], tokens: int = TOKENS, **kwargs) -> list[int]:
    with TARGET_LOCK:
        return generate(target, make_drafter("ar"), prompt, tokens, **kwargs).tokens


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def tiny_chat() -> Target:
    """A tiny random Llama with SmolLM2's tokenizer and chat template: the server's own logic over a real engine,
    a few ms per token."""
    tokenizer = AutoTokenizer.from_pretrained(resolve(MODEL))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    return Target(LlamaForCausalLM(config).float(), tokenizer, name="tiny-chat")


@pytest.fixture(scope="module")
def reference(smollm2):
    """Plain decoding of the chat question and the raw prompt: (prompt tokens, new tokens)."""
    prompts = {"chat": smollm2.encode_prompt(QUESTION), "completion": smollm2.encode_prompt(PROMPT, chat=False)}
    return {kind: (prompt, plain(smollm2, prompt)) for kind, prompt in prompts.items()}


@pytest.fixture(scope="module")
def ar_server(smollm2, reference):
    with serving(smollm2) as (url, _):
        yield url


@pytest.fixture(scope="module", params=available_methods(MODEL, None))
def method_server(request, smollm2, reference):
    with serving(smollm2, request.param) as (url, _):
        yield url, request.param


# ---- end to end: the text is plain decoding's ------------------------------------------------------------------
@pytest.mark.real
def test_every_method_answers_as_plain_decoding(method_server, reference, smollm2):
    url, method = method_server
    assert method in ("ar", "pld", "rest", "dflash", "ddtree", "treeflash", "tfm")
    c = client(url)
    (chat_prompt, chat_tokens), (raw_prompt, raw_tokens) = reference["chat"], reference["completion"]
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                     max_tokens=TOKENS, temperature=0)
    assert chat.choices[0].message.content == smollm2.decode(chat_tokens)
    assert chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(chat_prompt), TOKENS)
    extension = chat.model_extra["treeflash"]
    assert extension["method"] == method and extension["tau"] >= 1 and extension["rounds"] >= 1
    assert 0 <= extension["mean_tree_size"] <= 16

    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == smollm2.decode(raw_tokens)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    assert chunks[-1].usage.prompt_tokens == len(raw_prompt) == len(smollm2.tokenizer(PROMPT).input_ids)


@pytest.mark.real
def test_streamed_chat_and_plain_completion(ar_server, reference, smollm2):
    c = client(ar_server)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=TOKENS, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == smollm2.decode(reference["chat"][1])
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["treeflash"]["method"] == "ar"
    done = c.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=TOKENS)
    assert done.object == "text_completion" and done.choices[0].text == smollm2.decode(reference["completion"][1])
    assert done.usage.total_tokens == len(reference["completion"][0]) + TOKENS


@pytest.mark.real
def test_a_conversation_goes_through_the_chat_template(ar_server, smollm2):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]}]
    tok = smollm2.tokenizer
    plain_messages = messages[:3] + [{"role": "user", "content": "And 3 + 3?"}]
    prompt = tok(tok.apply_chat_template(plain_messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    answer = client(ar_server).chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.choices[0].message.content == smollm2.decode(plain(smollm2, prompt, 12))


@pytest.mark.real
def test_a_seed_gives_the_engine_s_sample(ar_server, smollm2):
    c = client(ar_server)
    texts = [c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7).choices[0].text
             for _ in range(2)]
    sample = plain(smollm2, smollm2.encode_prompt(PROMPT, False), 8, sampling=Sampling(1.0), seed=7)
    assert texts == [smollm2.decode(sample)] * 2


# ---- stop strings ------------------------------------------------------------------------------------------------
@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_before_the_first_match(ar_server, reference, smollm2, stream):
    tokens = reference["chat"][1]
    text = smollm2.decode(tokens)
    late, early = text[len(text) * 2 // 3:][:5], text[len(text) // 3:][:6]  # two stops spanning tokens, likely
    cut = min(text.index(late), text.index(early))
    needed = next(k for k in range(1, len(tokens) + 1) if late in smollm2.decode(tokens[:k])
                  or early in smollm2.decode(tokens[:k]))
    c = client(ar_server)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=TOKENS, stop=[late, early])
    if stream:
        chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        out = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish, used = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1], chunks[-1].usage
    else:
        answer = c.chat.completions.create(**kwargs)
        out, finish, used = answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage
    assert 0 < cut and out == text[:cut] and finish == "stop"
    assert used.completion_tokens == needed < TOKENS


def test_text_stream_holds_back_what_may_start_a_stop():
    stream = TextStream(lambda ids: "".join(map(chr, ids)), stops=["abc", "zz"])
    assert [stream.add(ord(ch)) for ch in "xabyab"] == ["x", "", "", "aby", "", ""]
    assert [stream.add(ord(ch)) for ch in "cq"] == ["", ""] and stream.stopped and stream.text == "xaby"
    partial = TextStream(lambda ids: "é" if len(ids) > 1 else "\ufffd")  # a character in two tokens
    assert (partial.add(1), partial.add(2), partial.finish()) == ("", "é", "")
    held = TextStream(lambda ids: "".join(map(chr, ids)), stops=["ab"])
    assert (held.add(ord("a")), held.finish()) == ("", "a")


# ---- bad requests ------------------------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
DONE = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
BAD = [  # (endpoint, body, status, param)
    ("chat/completions", '{"model": "x", "messages": [', 400, None),
    ("chat/completions", {**CHAT, "messages": "Hi"}, 400, "messages"),
    ("chat/completions", {**CHAT, "max_tokens": "2"}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": " "}]}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model"),
    ("chat/completions", {**CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "temperature": 2.5}, 400, "temperature"),
    ("chat/completions", {**CHAT, "temperature": -0.1}, 400, "temperature"),
    ("chat/completions", {**CHAT, "temperature": 1e-220}, 400, "temperature"),  # rounds to 0 in fp32
    ("chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("chat/completions", {**CHAT, "n": 2}, 400, "n"),
    ("chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat/completions", {**CHAT, "logit_bias": {"42": 5}}, 400, "logit_bias"),
    ("chat/completions", {**CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("chat/completions", {**CHAT, "frequency_penalty": -1}, 400, "frequency_penalty"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {**DONE, "prompt": ""}, 400, "prompt"),
    ("completions", {**DONE, "prompt": "\u0016"}, 400, "prompt"),  # a control character: no tokens at all
    ("completions", {**DONE, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {**DONE, "prompt": "word " * 9000}, 400, "prompt"),
    ("completions", {**DONE, "best_of": 3}, 400, "best_of"),
    ("completions", {**DONE, "echo": True}, 400, "echo"),
    ("completions", {**DONE, "logprobs": 2}, 400, "logprobs"),
    ("completions", [DONE], 400, None),
]


@pytest.mark.real
def test_bad_requests_get_openai_errors_and_the_server_goes_on(ar_server):
    with httpx.Client(base_url=ar_server + "/v1", timeout=60) as http:
        for endpoint, body, status, param in BAD:
            sent = dict(content=body, headers={"content-type": "application/json"}) if isinstance(body, str) \
                else dict(json=body)
            answer = http.post(endpoint, **sent)
            assert answer.status_code == status, (body, answer.text)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], body
            assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
        assert http.post("completions", json={**DONE, "prompt": "word " * 9000}).json()["error"]["code"] \
            == "context_length_exceeded"
        assert http.post("chat/completions", json={**CHAT, "model": "x"}).json()["error"]["code"] == "model_not_found"
        ok = http.post("chat/completions", json={**CHAT, "n": 1, "user": "u", "whatever": [1], "logprobs": False,
                                                 "presence_penalty": 0, "stop": "never-seen"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.real
def test_api_key(smollm2):
    with serving(smollm2, api_key="sekret") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.post(url + "/v1/completions", json=DONE).json()["error"]["code"] == "invalid_api_key"
        assert [m.id for m in client(url, "sekret").models.list()] == [MODEL]
        assert client(url, "sekret").completions.create(**DONE).usage.completion_tokens == 2
        assert httpx.get(url + "/health").status_code == 200
    with serving(smollm2) as (url, _):  # no key configured: any key, or none, is fine
        assert httpx.get(url + "/v1/models").status_code == 200


def test_an_error_lists_every_problem_of_the_request(tiny_chat):
    with serving(tiny_chat) as (url, _), httpx.Client(base_url=url + "/v1", timeout=WAIT_S) as http:
        body = {**CHAT, "max_tokens": "2", "temperature": "hot", "messages": [{"role": "robot", "content": "Hi"}]}
        error = http.post("chat/completions", json=body).json()["error"]
        assert error["param"] == "max_tokens", error  # the first, in the order of the fields
        for where in ("max_tokens: ", "temperature: ", "messages.0.role: "):
            assert where in error["message"], error
        error = http.post("chat/completions", json={**CHAT, "n": 2, "logprobs": True, "tools": [{}]}).json()["error"]
        assert error["param"] == "n" and error["code"] == "unsupported_parameter", error
        for name in ("n=2", "logprobs=True", "tools=[{}]"):
            assert name in error["message"], error


# ---- fuzzing every endpoint from its OpenAPI schema --------------------------------------------------------------
FUZZ_EXAMPLES = 50  # requests per endpoint
FUZZ_DEFAULT_TOKENS = 8  # what a fuzzed request that names no max_tokens gets: short, as the test must be
KEY = "sekret"


def test_fuzzed_requests_never_get_a_5xx_and_the_server_goes_on(tiny_chat):
    """Requests built from the app's own OpenAPI schema, most of them broken on purpose (openapi_fuzz), against the
    real engine on a tiny target behind an API key: each answer is below 500, a 4xx is OpenAI's error object, and
    no stream carries a server error; afterwards a plain request still gets plain decoding's answer."""
    worker = Worker(locked_engine(tiny_chat), tiny_chat.eos_ids)
    app = create_app(tiny_chat, worker, Settings(model=MODEL, method="ar", api_key=KEY, max_tokens=FUZZ_DEFAULT_TOKENS))
    openapi = app.openapi()
    ops = operations(openapi)
    assert {(op.method, op.path) for op in ops} == {("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                                    ("POST", "/v1/completions"), ("GET", "/health"),
                                                    ("GET", "/metrics")}  # a new endpoint: fuzzed as well
    hints = {"model": st.just(MODEL), "authorization": st.just(f"Bearer {KEY}")}
    with running(app) as (url, _), httpx.Client(base_url=url, timeout=WAIT_S) as http:
        for op in ops:
            @hypothesis_settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
            @given(request=requests(op, openapi, hints))
            def answered(request):
                answer = http.request(**request)
                assert answer.status_code < 500, (request, answer.text)
                assert '"type":"server_error"' not in answer.text, (request, answer.text)  # streamed errors too
                if answer.status_code >= 400:
                    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}, answer.text

            answered()
        assert worker.thread.is_alive() and http.get("/health").json()["queue_depth"] == 0
        ok = http.post("/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    expected = tiny_chat.decode(plain(tiny_chat, tiny_chat.encode_prompt(PROMPT, chat=False), 8))
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected


# ---- what a request leaves out, and tokenising ------------------------------------------------------------------
def test_a_request_without_temperature_gets_the_server_default(tiny_chat):
    """OpenAI's default of 1 unless the server sets another (`serve --default-temperature`); a request's own wins."""
    prompt = tiny_chat.encode_prompt(PROMPT, chat=False)
    sample = tiny_chat.decode(plain(tiny_chat, prompt, 8, sampling=Sampling(DEFAULT_TEMPERATURE), seed=7))
    greedy = tiny_chat.decode(plain(tiny_chat, prompt, 8))
    assert DEFAULT_TEMPERATURE == 1 and sample != greedy
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 7}
    for default, expected in ((None, sample), (0.0, greedy)):  # Settings' own default, then a server's 0
        chosen = {} if default is None else {"temperature": default}
        worker = Worker(locked_engine(tiny_chat), tiny_chat.eos_ids)
        with running(create_app(tiny_chat, worker, Settings(model=MODEL, method="ar", **chosen))) as (url, _):
            texts = [httpx.post(url + "/v1/completions", json={**body, **own}, timeout=WAIT_S).json()["choices"][0]
                     ["text"] for own in ({}, {"temperature": 0}, {"temperature": 1})]
        assert texts == [expected, greedy, sample], default


def test_tokenising_leaves_the_event_loop_free(tiny_chat):
    """A prompt held in the tokenizer (until a gate opens) must not stop the server answering other requests."""
    started, gate = threading.Event(), threading.Event()

    class SlowTokenizer:  # the target, with a tokenizer that waits for the gate
        def __getattr__(self, name):
            return getattr(tiny_chat, name)

        def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
            started.set()
            assert gate.wait(WAIT_S)
            return tiny_chat.encode_prompt(text, chat)

    with serving(SlowTokenizer(), decode=_fake(tiny_chat, threading.Event(), gate)) as (url, _), \
            httpx.Client(base_url=url, timeout=WAIT_S) as http:
        answers: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=DONE)))
        thread.start()
        try:
            assert started.wait(WAIT_S)  # the prompt is in the tokenizer, and stays there
            # a blocked event loop would answer only once the tokenizer gave up waiting (WAIT_S)
            assert http.get("/health", timeout=WAIT_S / 3).status_code == 200
        finally:
            gate.set()
            thread.join(WAIT_S)
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == " hello world"


# ---- the queue, timeouts, clients that leave, shutdown ----------------------------------------------------------
def _fake(target, started: threading.Event, gate: threading.Event, service_s: float = 0.0):
    """A decoder that never touches the model: it waits for `gate`, then emits the tokens of "hello world" and says
    that took `service_s` seconds."""
    def decode(job: Job) -> GenerationResult:
        started.set()
        assert gate.wait(WAIT_S)
        tokens = target.tokenizer(" hello world").input_ids
        for token in tokens:
            job.on_token(token)
        return GenerationResult(tokens, prefill_s=service_s)

    return decode


class FakeClock:
    """The server's clock for deadlines: it moves only when a test moves it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _wait_until(condition, seconds: float = WAIT_S) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_worker_serves_in_order_behind_a_bounded_queue():
    async def main():
        started, gate, seen = threading.Event(), threading.Event(), []

        def decode(job):
            seen.append(job.prompt[0])
            started.set()
            assert gate.wait(30)
            if job.prompt[0] == 1:
                raise RuntimeError("a bug")
            return GenerationResult([], 0.0)

        worker = Worker(decode, max_queue=2)
        worker.start()
        jobs = [Job([i], 4, Sampling(), 0, TextStream(str), time.monotonic() + 60) for i in range(5)]
        worker.submit(jobs[0])
        started.wait(30)  # decoding now: the queue is empty
        for job in jobs[1:3]:
            worker.submit(job)
        with pytest.raises(QueueFull):
            worker.submit(jobs[3])
        assert worker.depth == 2
        gate.set()
        events = [await job.events.get() for job in jobs[:3]]
        await asyncio.to_thread(worker.close)
        assert seen == [0, 1, 2] and [kind for kind, _ in events] == ["done", "error", "done"]
        assert isinstance(events[1][1], APIError) and events[1][1].status == 500  # the worker survived the bug

    asyncio.run(main())


SERVICE_S = 2.5  # what the fake generations say they took


def test_full_queue_answers_429_with_retry_after_from_the_queue(tiny_chat):
    """Retry-After: the requests waiting times the recent mean service time, at least 1 s."""
    started, gate = threading.Event(), threading.Event()
    with serving(tiny_chat, decode=_fake(tiny_chat, started, gate, SERVICE_S), max_queue=2) as (url, _):
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            def fill_and_overflow() -> httpx.Response:
                """One request decoding (held at the gate), two waiting: the next one is turned away."""
                results: list[httpx.Response] = []
                threads = [threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=DONE)))
                           for _ in range(3)]
                threads[0].start()
                assert started.wait(WAIT_S)  # the first request decodes
                for t in threads[1:]:
                    t.start()
                _wait_until(lambda: http.get("/health").json()["queue_depth"] == 2)  # the others wait
                busy = http.post("/v1/completions", json=DONE)
                gate.set()
                for t in threads:
                    t.join(WAIT_S)
                assert [r.status_code for r in results] == [200] * 3
                assert results[0].json()["choices"][0]["text"] == " hello world"
                started.clear(), gate.clear()
                return busy

            first = fill_and_overflow()  # no generation has ended yet: nothing to estimate from
            assert first.status_code == 429 and first.headers["retry-after"] == "1"
            assert first.json()["error"]["code"] == "rate_limit_exceeded"
            later = fill_and_overflow()  # three generations of SERVICE_S each have ended since
            assert later.status_code == 429 and later.headers["retry-after"] == str(math.ceil(2 * SERVICE_S))
            assert 'treeflash_requests_total{code="429"} 2' in http.get("/metrics").text


def test_retry_after_shares_the_wait_among_the_batch_slots():
    engine = SimpleNamespace(slots=SimpleNamespace(max_batch=4))
    for worker, expected in ((Worker(None, max_queue=8), 24), (BatchWorker(engine, max_queue=8), 6)):
        worker.service_s.extend([3.0, 5.0])  # a mean of 4 s
        for _ in range(6):
            worker.queue.put_nowait(object())  # six waiting (never started: nothing takes them)
        assert worker.retry_after() == expected


TIMEOUT_S = 5.0  # on the fake clock


def test_timeout_ends_the_request_with_an_error(tiny_chat):
    clock, decoded = FakeClock(), []

    def slow(job: Job) -> GenerationResult:  # one token, then rounds while the clock runs past the deadline
        decoded.append(job)
        job.on_token(tiny_chat.tokenizer(" hi").input_ids[0])
        clock.now += TIMEOUT_S / 2
        assert not job.should_stop(), "stopped before its --timeout"
        clock.now += TIMEOUT_S
        assert job.should_stop(), "went on past its --timeout"
        return GenerationResult([1], 0.0)

    with serving(tiny_chat, decode=slow, timeout=TIMEOUT_S, clock=clock) as (url, _):
        answer = httpx.post(url + "/v1/completions", json=DONE, timeout=WAIT_S)
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "timeout"
        with pytest.raises(openai.APIError, match="timeout"):
            list(client(url).completions.create(**DONE, stream=True))
    assert len(decoded) == 2  # both timed out while decoding, none in the queue


PAUSE_AT = 4  # tokens a held generation makes before it waits for its client to leave


def test_clients_that_leave_stop_their_generation(tiny_chat):
    """The real engine, held after PAUSE_AT tokens until its request is cancelled: a client that leaves, streamed
    or not, must cancel it, and the engine then stops at the next round."""
    engine = locked_engine(tiny_chat)
    holding, paused, ended, made = threading.Event(), threading.Event(), threading.Event(), []

    def decode(job: Job) -> GenerationResult:
        emit, count = job.on_token, [0]

        def on_token(token: int) -> None:
            emit(token)
            count[0] += 1
            if holding.is_set() and count[0] == PAUSE_AT:
                paused.set()
                if not job.cancelled.wait(WAIT_S):
                    raise RuntimeError("never cancelled")  # ends the generation: `made` stays empty

        job.on_token = on_token
        try:
            result = engine(job)
            made.append(len(result.tokens))
            return result
        finally:
            ended.set()

    def left(leave) -> int:
        """Tokens made by a request whose client leaves once its generation is held."""
        holding.set(), paused.clear(), ended.clear(), made.clear()
        leave()
        assert ended.wait(2 * WAIT_S), "the held generation never ended"
        assert made, "the client left, but its request was not cancelled"
        return made[-1]

    long = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 2000, "temperature": 0}
    with serving(tiny_chat, decode=decode) as (url, _):
        def streamed():
            with httpx.stream("POST", url + "/v1/chat/completions", json={**long, "stream": True},
                              timeout=WAIT_S) as events:
                assert events.status_code == 200 and paused.wait(WAIT_S)  # then the client leaves mid-stream

        def not_streamed():
            body = json.dumps(long).encode()
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
                assert paused.wait(WAIT_S)  # then the client hangs up before any answer came

        assert left(streamed) == PAUSE_AT and left(not_streamed) == PAUSE_AT  # not the 2000 asked for
        holding.clear()
        answer = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)  # the server goes on
        assert answer.choices[0].text == tiny_chat.decode(plain(tiny_chat, tiny_chat.encode_prompt(PROMPT, False), 8))


@pytest.mark.real
def test_metrics_count_what_was_served(ar_server, reference):
    def scrape() -> dict[str, float]:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in httpx.get(ar_server + "/metrics").text.splitlines() if not line.startswith("#")}

    before = scrape()
    client(ar_server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS)
    httpx.post(ar_server + "/v1/completions", json={**DONE, "n": 3})
    after = scrape()
    assert after["treeflash_prompt_tokens_total"] - before["treeflash_prompt_tokens_total"] \
        == len(reference["completion"][0])
    assert after["treeflash_completion_tokens_total"] - before["treeflash_completion_tokens_total"] == TOKENS
    assert after['treeflash_requests_total{code="400"}'] - before.get('treeflash_requests_total{code="400"}', 0) == 1
    assert after['treeflash_requests_total{code="200"}'] > before['treeflash_requests_total{code="200"}']
    assert after["treeflash_tau_count"] == before["treeflash_tau_count"] + 1 and after["treeflash_queue_depth"] == 0
    assert after['treeflash_tau_bucket{le="1.0"}'] == after["treeflash_tau_count"]  # ar: tau 1 exactly
    assert after["treeflash_time_per_output_token_seconds_count"] == after["treeflash_tau_count"]


@pytest.mark.real
def test_shutdown_finishes_the_request_in_flight(smollm2, reference):
    with serving(smollm2) as (url, server):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "stream": True}) as events:
            lines = events.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            server.should_exit = True  # what uvicorn does on SIGTERM
            rest = [line for line in lines if line.startswith("data:")]
    texts = [json.loads(line[5:])["choices"][0]["text"] for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]" and "".join(texts) == smollm2.decode(reference["completion"][1])


# ---- batching --------------------------------------------------------------------------------------------------
@pytest.mark.real
@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_batched_server_answers_each_client_as_plain_decoding(smollm2, reference, method):
    """--max-batch 3: five concurrent clients (more than the slots: they join as others leave), streamed and not,
    chat and completion, one that leaves early; every answer is plain decoding's, and shutdown drains the batch."""
    engine = BatchEngine(smollm2, make_drafter(method, smollm2), max_batch=3, budget=8)
    worker = BatchWorker(engine, smollm2.eos_ids)
    app = create_app(smollm2, worker, Settings(model=MODEL, method=method, temperature=0.0))
    (_, chat_tokens), (_, raw_tokens) = reference["chat"], reference["completion"]
    with running(app) as (url, server):
        c = client(url)

        def chat(stream: bool) -> str:
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=TOKENS,
                          temperature=0)
            if stream:
                return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kwargs,
                                                                                                   stream=True))
            return c.chat.completions.create(**kwargs).choices[0].message.content

        def completion(stream: bool) -> str:
            answer = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=stream)
            return "".join(ch.choices[0].text for ch in answer) if stream else answer.choices[0].text

        def leaver() -> str:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                    "max_tokens": 2000, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as events:
                data = [line for line, _ in zip((x for x in events.iter_lines() if x.startswith("data:")), range(3))]
            assert len(data) == 3, (events.status_code, data)  # three chunks, then the client leaves
            return "left"

        async def all_at_once():
            calls = [(chat, True), (chat, False), (completion, True), (completion, False), (leaver,)]
            return await asyncio.gather(*(asyncio.to_thread(*call) for call in calls))

        answers = asyncio.run(all_at_once())
        assert answers == [smollm2.decode(chat_tokens)] * 2 + [smollm2.decode(raw_tokens)] * 2 + ["left"]
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "stream": True}) as events:
            lines = events.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            server.should_exit = True  # SIGTERM: the request in the batch finishes
            rest = [line for line in lines if line.startswith("data:")]
    texts = [json.loads(line[5:])["choices"][0]["text"] for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]" and "".join(texts) == smollm2.decode(raw_tokens)
    assert len(engine) == 0  # the leaver's sequence left the batch
