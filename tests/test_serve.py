"""`hf-loopspec serve`: transformers' own server with the package's model, started in this process (a thread) on a
free localhost port, answers concurrent `openai` clients on /v1/completions and /v1/chat/completions, streaming and
not, with exactly the tokens of plain greedy `generate` of each prompt alone, decoding speculatively as the
checkpoint's generation config says; with and without continuous batching. Bad MODEL paths and options are one line
and exit status 2."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import pickle
import re
import shutil
import socket
import threading
import time
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
import transformers
from cli_utils import one_error_line
from tolerances import fp32_tolerance, ouro_depth
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cli.serve import Serve

import hf_loopspec
from hf_loopspec import cli, serving, serving_batching, serving_requests, serving_streams
from hf_loopspec.generation import mixin
from hf_loopspec.generation.continuous.manager import LoopBatchingManager
from hf_loopspec.generation.dispatch import SpeculativeRequest
from hf_loopspec.generation.wavefront.state import COUNTERS

NEW_TOKENS = 6
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(", "    return", "# Read the file",
           "x = [", "while True:"]
# The embedded model has no chat template; the served copy gets this one.
TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")
READY_SECONDS = 60
# A request's own generation settings: block speculation (the keys left out keep the checkpoint's values).
BLOCK = {"speculative_mode": "block", "num_speculative_tokens": 3, "do_sample": False, "eos_token_id": 0,
         "pad_token_id": 0}
# transformers >= 5.25 runs the served model in a process of its own (`serving_engine`), and has no `--non-blocking`
OWN_PROCESS = not hasattr(Serve, "kill_server")
CASES = [(endpoint, prompt, i % 2 == 0) for i, prompt in enumerate(PROMPTS) for endpoint in ("completions", "chat")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The embedded model (its generation config: auto speculation) with a chat template."""
    folder = tmp_path_factory.mktemp("served") / "model"
    shutil.copytree(hf_loopspec.default_model_path(), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """`(tokenizer, plain)`: plain(ids) is plain greedy `generate`'s new tokens for one prompt, on a model loaded
    separately from the served one."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()

    def plain(ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, speculative_mode=None)
        return out[0, len(ids):].tolist()

    return tokenizer, plain


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def stand_in_served(monkeypatch, app, stops=None):
    """`app` (a stand-in for transformers' server app) served in a thread as `transformers serve` builds its server,
    the package's middleware (`serving.openai_errors`, for a checkpoint of stop strings `stops`) added; yields its
    port, and stops it on leaving."""
    import uvicorn
    from transformers.cli.serving import server

    monkeypatch.setattr(server, "build_server", lambda *args, **kwargs: app)
    serving.openai_errors(stops=stops)
    port = free_port()
    stand_in = uvicorn.Server(uvicorn.Config(server.build_server(), host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=stand_in.run, daemon=True)
    thread.start()
    try:
        while not stand_in.started:
            time.sleep(0.05)
        yield port
    finally:
        stand_in.should_exit = True
        thread.join(timeout=30)


class ThreadServer:
    """transformers >= 5.25: `serving.start` (which serves until stopped) in a thread; `kill_server` stops it."""

    def __init__(self, argv: list[str], patch):
        import uvicorn

        self.servers, original = [], uvicorn.Server

        def recording(*args, **kwargs):
            server = original(*args, **kwargs)
            self.servers.append(server)
            return server

        patch.setattr(uvicorn, "Server", recording)
        self.thread = threading.Thread(target=serving.start, args=(argv,), daemon=True)
        self.thread.start()

    def kill_server(self):
        for server in self.servers:
            server.should_exit = True
        self.thread.join(timeout=60)


def ran(calls) -> tuple[list, tuple | None]:
    """`([(mode, draft_loops, K) of each speculative generate], (mode, accepted drafts) of the manager or None)`."""
    if OWN_PROCESS:
        records = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
        managers = [(r["manager"], r["accepted"]) for r in records if "manager" in r]
        return [tuple(r["spec"]) for r in records if "spec" in r], managers[-1] if managers else None
    managers = [c for c in calls if isinstance(c, LoopBatchingManager)]
    assert len(managers) <= 1
    settings = [(r.spec.mode, r.spec.draft_loops, r.spec.num_speculative_tokens) for r in calls
                if isinstance(r, SpeculativeRequest)]
    manager = None
    if managers:
        counters = managers[0].batch_processor.state.counters
        manager = (managers[0].settings.mode, int(counters[:, COUNTERS.index("accepted")].sum()))
    return settings, manager


def start_server(checkpoint: str, *options: str):
    """`(Serve, client, calls, patch)`: the server running in a thread, an `openai` client for it, what records every
    speculative `generate` the server runs and every continuous-batching manager it starts (read it with `ran`), and
    the patch that records them (undo it after stopping)."""
    port = free_port()
    patch = pytest.MonkeyPatch()
    argv = [checkpoint, "--port", str(port), "--host", "127.0.0.1", "--device", "cpu"]
    if OWN_PROCESS:
        from serve_recording import RecordingLoader
        from transformers.cli.serving import model_manager

        from hf_loopspec import serving_engine

        calls = Path(checkpoint).parent / f"records-{port}.jsonl"
        patch.setattr(RecordingLoader, "path", str(calls))
        patch.setattr(serving_engine, "LoopModelLoader", RecordingLoader)
        patch.setattr(model_manager, "ModelLoader", model_manager.ModelLoader)  # restored by `patch.undo()`
        server = ThreadServer([*argv, *options], patch)
    else:
        calls, server = start_in_process(argv, options, patch)
    deadline = time.monotonic() + READY_SECONDS
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                server.kill_server()
                raise TimeoutError(f"the server did not answer /health within {READY_SECONDS} s") from None
            time.sleep(0.1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    return server, client, calls, patch


def start_in_process(argv, options, patch):
    """transformers 5.24: the server with `--non-blocking`, recording in this process."""
    calls = []
    original, original_start = mixin.run_speculative, LoopBatchingManager.start

    def recording(model, request):
        calls.append(request)
        return original(model, request)

    def recording_start(manager):
        calls.append(manager)
        return original_start(manager)

    patch.setattr(mixin, "run_speculative", recording)
    patch.setattr(LoopBatchingManager, "start", recording_start)
    return calls, serving.start([*argv, "--non-blocking", *options])


def ask(client, model: str, endpoint: str, prompt: str, stream: bool) -> tuple[str, int | None]:
    """`(text, completion tokens or None when the stream does not report them)` of one request; endpoint "block" is
    /v1/completions with a `generation_config` of the request's own that asks for block speculation."""
    if endpoint in ("completions", "block"):
        extra = {"generation_config": json.dumps(BLOCK)} if endpoint == "block" else None
        usage = {"stream_options": {"include_usage": True}} if stream else {}  # 5.25: the usage only when asked
        response = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, stream=stream,
                                             extra_body=extra, **usage)
        if not stream:
            return response.choices[0].text, response.usage.completion_tokens
        chunks = list(response)
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
    messages = [{"role": "user", "content": prompt}]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS, stream=stream)
    if not stream:
        return response.choices[0].message.content or "", response.usage.completion_tokens
    return "".join(c.choices[0].delta.content or "" for c in response if c.choices), None


def expected(reference, endpoint: str, prompt: str) -> tuple[str, int]:
    tokenizer, plain = reference
    if endpoint in ("completions", "block"):
        ids = tokenizer(prompt)["input_ids"]
    else:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    new = plain(ids)
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def check_concurrent_requests(checkpoint, reference, cases, *options: str, then=None) -> list:
    """The `(endpoint, prompt, stream)` cases all in flight at once; each answer equals plain `generate`. Returns what
    the server ran (`start_server`'s calls); `then(client, calls)` runs on the server after the cases."""
    server, client, calls, patch = start_server(checkpoint, *options)
    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(lambda case: ask(client, checkpoint, *case), cases))
        if then is not None:
            then(client, calls)
    finally:
        server.kill_server()
        patch.undo()
    assert sum(bool(text) for text, _ in answers) > len(answers) // 2, answers  # the comparison is not vacuous
    for (endpoint, prompt, stream), (text, count) in zip(cases, answers):
        want_text, want_count = expected(reference, endpoint, prompt)
        assert text == want_text, (endpoint, prompt, stream)
        assert count in (None, want_count), (endpoint, prompt, stream)
    return calls


def test_serve_answers_concurrent_clients_as_plain_generate(checkpoint, reference):
    """Concurrent clients, each answered as plain `generate`; then a request whose settings `generate` refuses gets
    a 400 with the reason (a `ValueError`, not a bare 500), as do a fractional `max_tokens` and `n=2` (checked before
    transformers reads them: `serving_requests.request_problem`), and the server keeps serving."""

    def refused(client, calls):
        bad = {**BLOCK, "speculative_mode": "pipeline", "draft_loops": 3}  # U = 4 is not a multiple of 3
        kept, _ = ran(calls)
        for stream in (False, True):  # streaming: refused before its first token, a 400 too (it was an error event)
            reason = refusal(lambda stream=stream: client.completions.create(
                model=checkpoint, prompt=PROMPTS[0], max_tokens=4, stream=stream,
                extra_body={"generation_config": json.dumps(bad)}))
            assert re.search(r"Error code: 400 .*draft_loops=3", reason), (stream, reason)
            beams = refusal(lambda stream=stream: client.completions.create(  # (its advice, speculative_mode=None,
                model=checkpoint, prompt=PROMPTS[0], max_tokens=4, stream=stream,  # is what no request can send)
                extra_body={"generation_config": json.dumps({"speculative_mode": "pipeline", "num_beams": 2})}))
            assert re.search(r"Error code: 400 .*beam search .*A request to this server cannot set "
                             r"speculative_mode=None: leave speculative_mode out of it", beams), (stream, beams)
            failed = refusal(lambda stream=stream: client.completions.create(  # a failure, no refusal: 500 either way
                model=checkpoint, prompt=PROMPTS[0], max_tokens=4, stream=stream,
                extra_body={"generation_config": json.dumps({"num_beams": "x"})}))
            assert re.search(r"Error code: 500 .*the server failed on this request .*TypeError", failed), failed
        reason = refusal(lambda: client.responses.create(  # (a 200 stream of an error event, coded server_error)
            model=checkpoint, input=PROMPTS[0], max_output_tokens=4, stream=True,
            extra_body={"generation_config": json.dumps(bad)}))
        assert re.search(r"Error code: 400 .*draft_loops=3", reason), reason
        reason = refusal(lambda: client.completions.create(model=checkpoint, prompt=PROMPTS[0], max_tokens=1.5))
        assert re.search(r"Error code: 400 .*max_tokens=1.5 must be a whole number", reason), reason
        reason = refusal(lambda: client.completions.create(model=checkpoint, prompt=PROMPTS[0], max_tokens=10**6))
        assert re.search(r"Error code: 400 .*max_tokens=1000000 reaches the model's \d+ positions", reason), reason
        reason = refusal(lambda: client.chat.completions.create(
            model=checkpoint, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=4, n=2))
        assert re.search(r"Error code: 400 .*n=2 is not supported: this server returns one choice", reason), reason
        for body, content_type, status, message in MALFORMED:
            answer = post(client, "completions", body, content_type)
            assert answer[0] == status and message in answer[1]["error"]["message"], (body[:40], answer)
        refused.kept = kept  # what the refused requests ran, if anything, is not part of the checks below
        assert ask(client, checkpoint, "completions", PROMPTS[2], False)[0]
        if SYSTEMONE:  # the body reaches transformers' handler as sent (a `stream` added to it made every one a 422)
            status, answer = post(client, "systemone", json.dumps({"model": checkpoint, **DECISION}).encode(),
                                  "application/json")
            assert status == 200, answer
            check_decision(checkpoint, answer["answers"]["tone"])

    block = [("block", PROMPTS[0], False), ("block", PROMPTS[1], True)]
    check_concurrent_requests(checkpoint, reference, CASES + block, then=refused)
    # the requests with their own generation config: one block `generate` each (K = 3); the others decode as the
    # checkpoint says (auto: its speculative segments run the settings it chooses among, at the config's d = 1, K = 4)
    settings = refused.kept
    assert settings.count(("block", 1, BLOCK["num_speculative_tokens"])) == len(block)
    assert set(settings) <= {("block", 1, BLOCK["num_speculative_tokens"]), ("pipeline", 1, 4), ("block", 1, 4)}


SYSTEMONE = importlib.util.find_spec("transformers.cli.serving.systemone") is not None  # (transformers >= 5.25)
DECISION = {"state": "def f(x):",
            "questions": {"tone": {"type": "choice", "criteria": {"calm": "polite", "angry": None}}}}


def check_decision(checkpoint: str, got: dict) -> None:
    """`got`, the server's answer to `DECISION`'s question, is what transformers' decision code answers for the
    checkpoint loaded in this process. Both evaluate the same fp32 forward; the tolerance is the forward's
    depth-derived rtol (`tolerances`), far below what a wrong prompt, model or label moves these probabilities by."""
    from transformers.cli.serving.utils import answer_questions
    from transformers.decision import DecisionConfig

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    answers, _ = answer_questions(model, AutoTokenizer.from_pretrained(checkpoint), DECISION, DecisionConfig())
    want = answers["tone"]
    bound = fp32_tolerance(**ouro_depth(model.config))["rtol"]
    assert got["choice"] == want["choice"] and set(got["probabilities"]) == {"calm", "angry"}
    assert got["probabilities"] == pytest.approx(want["probabilities"], abs=bound)


# (body, content type, status, part of the message): bodies FastAPI or transformers' handlers answered with a bare
# 500 or in FastAPI's own shape, or whose checks a content type spelled otherwise skipped
MALFORMED = [
    (b'{"prompt": "x", "max_tokens": 3, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", 400,
     "nests too deeply"),
    (b'{"prompt": "x", ', "application/json", 400, "not valid JSON"),
    (b'{"prompt": "x", "max_tokens": 3, "n": 3}', "Application/JSON", 400, "n=3 is not supported"),
    (b'{"prompt": "Hi\\ud800", "max_tokens": 3}', "application/json", 400, "not valid Unicode"),
    (b"prompt=x", "text/plain", 422, "the request body: body: "),
]


def post(client, endpoint: str, body: bytes, content_type: str) -> tuple[int, dict]:
    """`(status, JSON answer)` of a raw POST of `body` to the server of `client`."""
    request = urllib.request.Request(f"{client.base_url}{endpoint}", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_refusals_reach_the_model_as_text():
    """transformers' handlers drop a refusal without a word: a refusal part (in a message, or in the Responses API's
    flat list of parts) and a replayed assistant message's `refusal` field (the `openai` client's shape) are
    rewritten as the text they hold; everything else is left as it is."""
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "refusal": "I can't."},
                         {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                         {"role": "assistant", "content": "Yes.", "refusal": None},
                         {"role": "assistant", "content": [], "refusal": "Never."}]}
    assert serving_requests.as_transformers_reads(chat)["messages"] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "I can't.", "refusal": "I can't."},
        {"role": "assistant", "content": [{"type": "text", "text": "No."}]},
        {"role": "assistant", "content": "Yes.", "refusal": None},
        {"role": "assistant", "content": "Never.", "refusal": "Never."}]
    flat = {"input": [{"type": "input_text", "text": "hi"}, {"type": "refusal", "refusal": "No."}]}
    assert serving_requests.as_transformers_reads(flat)["input"] == [{"type": "input_text", "text": "hi"},
                                                                     {"type": "text", "text": "No."}]
    items = {"input": [{"role": "user", "content": "hi"}, {"type": "refusal", "refusal": "No."}]}  # an item, no part
    assert serving_requests.as_transformers_reads(items) == {**items, "stream": False}  # (OpenAI's default, stated)
    assert serving_requests.request_problem(chat, path="/v1/chat/completions") is None  # (content None: its refusal)
    problem = serving_requests.request_problem({"messages": [{"role": "assistant", "content": None, "refusal": 5}]},
                                               path="/v1/chat/completions")  # (dropped without a word before)
    assert "and any refusal as text" in problem


def test_a_streams_error_event_comes_in_openais_shape():
    """transformers' handlers end a failing stream with `data: {"error": "text"}`, whose text the `openai` client
    drops; the server rewrites it as `{"error": {"message": ...}}`, typed as a refusal or, for a failure that
    `tag_stream_errors` recorded, a server error, and leaves every other event as it was."""
    events = [b'data: {"choices": []}\n\n', "data: {\"text\": \"\u00e9\"}\n\n".encode()[:-5],  # a split character
              b'data: {"error": "stop', b'data: {"error": "stop_strings: not served"}\n\n']

    async def stream():
        for event in events:
            yield event

    async def collect():
        return [chunk async for chunk in serving_streams.openai_error_events(stream())]

    *kept, last = asyncio.run(collect())
    assert kept == events[:3]  # every other chunk as it came, a split character or event included
    error = json.loads(last.decode()[len("data: "):])["error"]
    assert error == {"message": "stop_strings: not served", "type": "invalid_request_error", "code": 400}

    serving_streams.STREAM_FAILURES.append(("stop_strings: not served", 500))  # a failure (`tag_stream_errors`)
    *_, failed = asyncio.run(collect())
    error = json.loads(failed.decode()[len("data: "):])["error"]
    assert error == {"message": "stop_strings: not served", "type": "server_error", "code": 500}
    assert ("stop_strings: not served", 500) not in serving_streams.STREAM_FAILURES  # (taken: its text may come again)

    async def ended():  # a chat or completions stream: OpenAI's last event (transformers sent none)
        return [chunk async for chunk in serving_streams.openai_error_events(stream(), done=True)]

    assert asyncio.run(ended()) == [*kept, last, b"data: [DONE]\n\n"]


def test_a_stream_that_fails_before_its_first_token_is_found():
    """An error event before any token (after a chat stream's role-only first event, or a Responses stream's opening
    events) is found, for the server to answer with the status the request gets without streaming; a stream whose
    first event carries a token, or whose error comes after one, is sent on whole."""
    role = b'data: {"choices": [{"delta": {"role": "assistant", "content": null}, "index": 0}]}\n\n'
    error = b'data: {"error": "draft_loops=3: refused"}\n\n'
    token = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'

    async def scan(events):
        async def stream():
            for event in events:
                yield event

        chunks = stream()
        message, read = await serving_streams.error_before_tokens(chunks)
        return message, [chunk async for chunk in serving_streams.replayed(read, chunks)]

    # the Responses API: its opening events carry no token (transformers sends them as one chunk), its error event
    # is typed; an output item (a token's) comes before any text
    opening = b'data: {"type": "response.created"}\n\ndata: {"type": "response.in_progress"}\n\n'
    typed = b'data: {"message": "draft_loops=3: refused", "type": "error"}\n\ndata: {"type": "response.failed"}\n\n'
    item = b'data: {"item": {"type": "message"}, "type": "response.output_item.added"}\n\n'
    for events, message in [([error], "draft_loops=3: refused"), ([role, error], "draft_loops=3: refused"),
                            ([token, error], None), ([role, token, error], None), ([], None),
                            ([opening, typed], "draft_loops=3: refused"), ([opening + typed], "draft_loops=3: refused"),
                            ([opening, item, typed], None), ([opening[:30], typed], None)]:
        assert asyncio.run(scan(events)) == (message, events)


def test_stream_errors_record_the_failures_that_are_no_refusal():
    """transformers' stream errors carry a message only; tagged, those made while handling any exception but a
    `ValueError` are recorded with their status (503 for a dead engine, else 500), so a stream failing before its
    first token gets that status (a refusal: a 400)."""
    from transformers.cli.serving import model_manager
    from transformers.cli.serving import utils as serving_utils

    serving_streams.tag_stream_errors()
    serving_streams.tag_stream_errors()  # idempotent: one subclass, not a chain
    dead = getattr(serving_utils, "EngineDeadError", None)  # transformers >= 5.25: the model's process died
    for module in (model_manager, serving_utils)[0 if dead else 1:]:  # (5.24 makes them in `utils` alone)
        assert module._StreamError.__bases__[0].__name__ == "_StreamError"
        name = module.__name__
        errors = [TypeError(f"boom in {name}"), ValueError(f"refused in {name}")]
        errors += [dead(f"died in {name}")] if dead else []
        for error in errors:
            try:
                raise error
            except Exception as caught:
                module._StreamError(str(caught))
        recorded = [entry for entry in serving_streams.STREAM_FAILURES if entry[0].endswith(f"in {name}")]
        assert recorded == [(f"TypeError: boom in {name}", 500),  # (the type named: transformers sends str(error))
                            *([(f"EngineDeadError: died in {name}", 503)] if dead else [])]


def test_stream_errors_are_one_class_wherever_they_are_read():
    """The recording stream-error class is the one every serving module holds: with one subclass per module, a
    handler module imported later (`from .utils import _StreamError`) failed `isinstance` on the errors another
    module made, and sent them as text (a TypeError, and an empty stream instead of the refusal)."""
    from transformers.cli.serving import model_manager, utils

    serving_streams.tag_stream_errors()
    serving_streams.tag_stream_errors()  # (idempotent)
    assert utils._StreamError.records_failures
    assert getattr(model_manager, "_StreamError", utils._StreamError) is utils._StreamError


def test_a_chat_templates_own_refusal_is_a_400(monkeypatch, caplog):
    """A chat template's `raise_exception` (a refused system message) is the conversation's fault: HTTP 400 with its
    message (a 500 "the server failed", which the openai client retries), and no failure in the server's log; a
    template that does not parse stays a server failure."""
    from fastapi import FastAPI
    from jinja2 import TemplateError, TemplateSyntaxError

    async def refused(request):
        raise TemplateError("System role not supported")

    async def broken(request):
        raise TemplateSyntaxError("unexpected end of template", 1)

    app = FastAPI()
    app.router.add_route("/v1/chat/completions", refused, methods=["POST"])
    app.router.add_route("/v1/responses", broken, methods=["POST"])
    with stand_in_served(monkeypatch, app) as port:
        base = type("Client", (), {"base_url": f"http://127.0.0.1:{port}/v1/"})
        body = json.dumps({"messages": [{"role": "system", "content": "hi"}]}).encode()
        with caplog.at_level(logging.ERROR):
            status, answer = post(base, "chat/completions", body, "application/json")
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"
        assert "the server failed" not in caplog.text
        assert answer["error"]["message"] == "the model's chat template refuses this request: System role not supported"
        status, answer = post(base, "responses", b'{"input": "hi"}', "application/json")
        assert status == 500 and "TemplateSyntaxError: unexpected end of template" in answer["error"]["message"]


def test_the_servers_checks_on_a_stand_in_app(monkeypatch, caplog):
    """The checks `openai_errors` adds, around a stand-in for transformers' app (echoing what its handlers read):
    OpenAI's whole-number `logit_bias` reaches the chat handler as the floats transformers' `sequence_bias` takes
    (it answered 400 with its own message), /v1/completions refuses it (its handler drops it without a word), and a
    client that leaves before its answer is no server error (starlette's "No response returned." was logged with
    a traceback). Other endpoints' bodies (/v1/systemone's) reach their handlers as sent."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers.cli.serving import utils as serving_utils

    async def chat(request):
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(iter([b'data: {"choices": []}\n\n']), media_type="text/event-stream")
        return JSONResponse(body)

    async def echo(request):  # what /v1/systemone's handler reads (its schema forbids any field it does not name)
        return JSONResponse(await request.json())

    async def responses(request):  # a handler that fails on what a request lacks
        raise KeyError("type")

    async def completions(request):
        await asyncio.sleep(3)  # a slow answer, which the client below leaves before
        return JSONResponse({})

    app = FastAPI()
    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    app.router.add_route("/v1/responses", responses, methods=["POST"])
    app.router.add_route("/v1/systemone", echo, methods=["POST"])
    dead = getattr(serving_utils, "EngineDeadError", None)  # transformers >= 5.25: the model's process died

    async def died(request):
        raise dead("The model's process crashed (exit code -9).")

    app.router.add_route("/v1/died", died, methods=["POST"])
    if hasattr(serving_utils, "CancelOnDisconnect"):  # transformers >= 5.25 cancels a left request's handling
        app.add_middleware(serving_utils.CancelOnDisconnect)

    with stand_in_served(monkeypatch, app) as port:
        base = type("Client", (), {"base_url": f"http://127.0.0.1:{port}/v1/"})
        bias = {"7": 100, "9": -5.5}
        status, echoed = post(base, "chat/completions", json.dumps({"messages": [], "logit_bias": bias}).encode(),
                              "application/json")
        assert status == 200 and echoed["logit_bias"] == {"7": 100.0, "9": -5.5}
        assert all(type(value) is float for value in echoed["logit_bias"].values())
        streamed = urllib.request.Request(f"{base.base_url}chat/completions", method="POST",
                                          data=b'{"messages": [], "stream": true}',
                                          headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(streamed, timeout=60) as answer:  # OpenAI's end of a stream (none before)
            assert answer.read() == b'data: {"choices": []}\n\ndata: [DONE]\n\n'
        replayed = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "text", "text": "Well."}, {"type": "refusal", "refusal": "I can't."}]}]}
        status, echoed = post(base, "chat/completions", json.dumps(replayed).encode(), "application/json")
        assert status == 200 and echoed["messages"][1]["content"] == [  # (transformers dropped the refusal)
            {"type": "text", "text": "Well."}, {"type": "text", "text": "I can't."}]
        status, echoed = post(base, "chat/completions", b'{"messages": [], "stop": []}', "application/json")
        assert status == 200 and "stop" not in echoed  # OpenAI's "no stop" (transformers failed on it)
        decision = {"model": "m", "state": "x", "questions": {"q": {"type": "noul"}}, "n": 2, "stop": []}
        status, echoed = post(base, "systemone", json.dumps(decision).encode(), "application/json")
        assert status == 200 and echoed == decision  # (a `stream` added to every POST made /v1/systemone a 422)
        status, answer = post(base, "responses", b'{"input": "hi"}', "application/json")  # a bare text 500 before
        assert status == 500 and "the server failed on this request (KeyError: 'type')" in answer["error"]["message"]
        if dead is not None:  # transformers' 503, in OpenAI's shape (its own answer was {"error": "text"})
            status, answer = post(base, "died", b'{"input": "hi"}', "application/json")
            assert status == 503 and answer["error"]["message"] == "The model's process crashed (exit code -9)."
        status, answer = post(base, "completions", json.dumps({"prompt": "x", "logit_bias": bias}).encode(),
                              "application/json")
        assert status == 400 and "logit_bias is not supported on /v1/completions" in answer["error"]["message"]
        status, answer = post(base, "chat/completions", b'{"messages": [], "logit_bias": {"7": 101}}',
                              "application/json")
        assert status == 400 and "must map token ids (as strings) to numbers in [-100, 100]" in \
            answer["error"]["message"]
        caplog.clear()  # (the failing handler above logged its traceback, as it should)
        with caplog.at_level(logging.ERROR), socket.create_connection(("127.0.0.1", port)) as client:
            body = b'{"prompt": "x"}'
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.5)  # the request reached the handler; the client leaves
        time.sleep(3.5)  # the handler's answer has nobody to go to
        assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


def refusal(call) -> str:
    """The reason the server gave for refusing `call()`, as the `openai` client shows it: an HTTP error's exception
    text (the server answers in OpenAI's error shape, FastAPI's `detail` kept beside it), or a stream's error event."""
    with pytest.raises(openai.APIError) as refused:
        call()
    error = refused.value
    if isinstance(error, openai.APIStatusError):
        body = error.response.json()
        assert body["error"]["message"] == body["detail"] and body["error"]["code"] == error.status_code
    return str(error)  # a stream's error event: its message (the server sends it in OpenAI's shape)


def test_serve_with_continuous_batching_answers_as_plain_generate(checkpoint, reference):
    """16 clients at once (8 prompts, both endpoints, streaming and not) through one manager that speculates as the
    checkpoint says (auto, which a manager runs as pipeline, `settings.fixed_mode`: its slots accepted drafts); then
    requests it cannot serve get their reason at once, streaming or not, and the manager keeps serving."""

    def refusals(client, calls):
        speculative, (mode, accepted) = ran(calls)
        assert mode == "pipeline" and not speculative and accepted > 0
        fast = client.with_options(timeout=30)
        for stream in (False, True):  # streaming too: refused before its first token, a 400 (not an error event)
            assert re.search(r"Error code: 400 .*speculative_mode='block' \(the manager's: 'auto'\)",
                             refusal(lambda stream=stream: ask(fast, checkpoint, "block", PROMPTS[0], stream)))
        block = {"generation_config": json.dumps(BLOCK)}  # the Responses API's stream too
        assert re.search(r"Error code: 400 .*speculative_mode='block' \(the manager's: 'auto'\)", refusal(
            lambda: fast.responses.create(model=checkpoint, input=PROMPTS[0], stream=True, extra_body=block)))
        for stream in (False, True):  # past the model's positions: the server refuses it before any slot does
            def call(stream=stream):  # (a slot's own check: test_continuous_batching)
                response = fast.completions.create(model=checkpoint, prompt="x = [", max_tokens=5000, stream=stream)
                return list(response) if stream else response

            assert re.search(r"max_tokens=5000 reaches the model's \d+ positions", refusal(call)), stream
        assert ask(fast, checkpoint, "completions", PROMPTS[2], True)[0] == expected(reference, "completions",
                                                                                      PROMPTS[2])[0]

    check_concurrent_requests(checkpoint, reference, CASES, "--continuous-batching", then=refusals)


def test_model_defaults_to_the_embedded_model():
    assert serving.resolve_model(None) == serving.resolve_model("default") == hf_loopspec.default_model_path()


def test_a_model_without_chat_template_is_announced(checkpoint):
    assert "has no chat template" in serving.chat_template_note(hf_loopspec.default_model_path())
    assert serving.chat_template_note(checkpoint) is None


def test_the_architecture_resolves_where_transformers_serve_looks_it_up(checkpoint):
    served = serving.expose_architecture(checkpoint)  # (its generate judges stop strings on the generated text)
    assert issubclass(served, hf_loopspec.OuroForCausalLM) and served.__name__ == "OuroForCausalLM"
    assert transformers.OuroForCausalLM is served and served.generate is not hf_loopspec.OuroForCausalLM.generate


@pytest.mark.parametrize(("argv", "message"), [
    (["/no/such/folder"], "no such folder: /no/such/folder"),
    (["ouro-100m"], "random-weight benchmark shape"),
    (["--bogus"], "No such option: --bogus"),
    (["--port", "eighty"], "Invalid value for '--port'"),
    (["--port", "99999"], "--port 99999: pass a TCP port in [1, 65535]"),  # uvicorn listened on 99999 - 65536
    (["--port", "-5"], "--port -5: pass a TCP port in [1, 65535]"),
    (["--threads", "0"], "--threads 0"),
    (["--threads", "100000"], "--threads 100000: pass a number of CPU threads in [1, "),
    (["--threads", "abc"], "--threads abc: pass a number of CPU threads in [1, "),  # (argparse's usage and error)
    (["--device", "meta"], "--device meta"),
    (["a", "b"], "unexpected extra argument"),
    # a traceback of the model's process once it had loaded, naming ContinuousBatchingConfig's fields
    (["--continuous-batching", "--cb-num-blocks", "0"], "--cb-num-blocks 0: pass a whole number >= 1"),
    (["--cb-block-size", "-3"], "--cb-block-size -3: pass a whole number >= 1"),
    (["--cb-max-batch-tokens", "0"], "--cb-max-batch-tokens 0: pass a whole number >= 1"),
    (["--cb-max-memory-percent", "1.5"], r"--cb-max-memory-percent 1.5: pass a fraction in (0, 1]"),
    (["--cb-max-memory-percent", "0"], "--cb-max-memory-percent 0.0: pass a fraction"),
])
def test_bad_model_or_option_is_one_line_exit_2(capsys, argv, message):
    assert cli.main(["serve", *argv]) == 2
    assert message in one_error_line(capsys, "serve")


@pytest.mark.skipif(not OWN_PROCESS, reason="transformers >= 5.25 loads the model in a process of its own")
def test_a_checkpoint_that_does_not_load_is_one_line_exit_2(capsys, checkpoint, tmp_path):
    """Weights that do not match config.json fail in the model's process, which transformers re-raises as a
    `RuntimeError("ValueError: ...")` (before: its traceback, exit 1); the serve command says why in one line."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    assert cli.main(["serve", str(folder), "--port", str(free_port())]) == 2
    assert "the model did not load: The checkpoint does not match" in one_error_line(capsys, "serve")


@pytest.mark.parametrize("stops, options, named", [
    (["zzq"], ["--continuous-batching"], "names stop_strings=['zzq'], but a continuous-batching manager stops a "
     "request at its EOS ids and max_new_tokens only: serve it without --continuous-batching"),
    ([""], [], "names stop_strings=[''], which must be a non-empty string or a non-empty list of them: fix or remove "
     "them there"),
    ([""], ["--continuous-batching"], "names stop_strings=[''], which must be a non-empty string")])
def test_a_checkpoints_stop_strings_a_server_cannot_decode_with_are_one_line_before_the_model_loads(
        capsys, checkpoint, tmp_path, monkeypatch, stops, options, named):
    """A manager stops at EOS and the token limit only: the checkpoint's stop strings are refused at start, in one
    line naming the fix (it failed in the model's process: transformers' traceback, then "the model did not load",
    naming a fix for model.generate). Stop strings that generate refuses are refused too (the server, which judges
    them itself, decoded without them without a word)."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, "stop_strings": stops}))
    monkeypatch.setattr(serving, "openai_errors", lambda *a: pytest.fail("the server was set up"))
    assert cli.main(["serve", str(folder), "--port", str(free_port()), *options]) == 2
    assert named in one_error_line(capsys, "serve")


@pytest.mark.parametrize("saved, named", [
    ({"draft_loops": 5}, " sets draft_loops=5, which its model refuses (draft_loops=5 is outside [1, 3] for a model "
     "with 4"),
    ({"speculative_mode": "pipeline", "draft_loops": 3}, " sets speculative_mode='pipeline', draft_loops=3, which its "
     "model refuses (speculative_mode='pipeline' needs the loop count (4) to be a multiple of draft_loops=3"),
    # a file marked as derived from config.json: transformers drops its extra keys, the loaded model restores them
    ({"_from_model_config": True, "draft_loops": 5}, " sets draft_loops=5, which its model refuses"),
    ({"exit_at_step": 9}, ": exit_at_step=9 must be an integer in [0, 3] for a 4-loop model"),
    ({"_from_model_config": True, "exit_at_step": 1, "exit_threshold": 0.5}, ": Pass at most one of exit_at_step"),
    # the library's advice kept whole where it is not how a call clears a value ("or None for plain decoding")
    ({"speculative_mode": "lanes"}, " sets speculative_mode='lanes', which its model refuses (speculative_mode='lanes' "
     "is not supported; use one of ('pipeline', 'block', 'auto') or None for plain decoding)"),
])
@pytest.mark.parametrize("batching", [[], ["--continuous-batching"]])
def test_a_checkpoints_refused_setting_is_one_line_before_the_model_loads(
        capsys, checkpoint, tmp_path, monkeypatch, saved, named, batching):
    """A setting the checkpoint's generation config saves and its model refuses (speculative, exit options): the
    server started, and every request that did not override it got a 400 naming a value it never sent (with
    --continuous-batching: the model's process failed, naming no file)."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, **saved}))
    monkeypatch.setattr(serving, "openai_errors", lambda *a: pytest.fail("the server was set up"))
    assert cli.main(["serve", str(folder), "--port", str(free_port()), *batching]) == 2
    line = one_error_line(capsys, "serve")
    assert f"the checkpoint's generation_config.json{named}" in line, line
    assert line.endswith("correct the checkpoint's generation_config.json."), line


def test_a_hub_id_not_in_the_cache_while_offline_is_named_so(capsys, monkeypatch):
    """serve tried an uncached Hub id while the Hub was off, and blamed the connection without naming HF_HUB_OFFLINE
    (generate, batch and export say it)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli.main(["serve", "no-such-org/no-such-model", "--port", str(free_port())]) == 2
    assert ("no-such-org/no-such-model is not a local folder, and it is not in the local Hub cache while the Hub is "
            "off (HF_HUB_OFFLINE=1)") in one_error_line(capsys, "serve")


def test_an_address_in_use_is_one_line_exit_2_before_the_model_loads(capsys, monkeypatch):
    """A port another socket listens on is refused in one line (before: uvicorn's error inside 40 lines of log, exit
    3, after the model had loaded); nothing is loaded."""
    monkeypatch.setattr(serving, "expose_architecture", lambda *a: pytest.fail("the model was prepared"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"--host 127.0.0.1 --port {port}: the server cannot listen there" in one_error_line(capsys, "serve")


def test_several_api_servers_are_refused(capsys):
    """transformers >= 5.25 can run API servers in processes spawned afresh, without the package's request checks."""
    assert cli.main(["serve", "--api-server-count", "2"]) == 2
    expected = "--api-server-count 2: hf-loopspec serve runs one API server" if OWN_PROCESS else "No such option"
    assert expected in one_error_line(capsys, "serve")


def test_a_file_as_model_is_one_line_exit_2(capsys, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    assert cli.main(["serve", str(tmp_path / "weights.bin")]) == 2
    assert "is a file; pass the checkpoint folder" in one_error_line(capsys, "serve")


def test_a_request_joins_a_running_manager_only_with_its_settings(checkpoint):
    """`serving_batching`: a request's settings are the checkpoint's overlaid with what it sets (as `generate` merges
    them); only max_new_tokens and EOS may differ from the manager's, sampling keys only matter when sampling; the
    first request's settings that no manager runs are an HTTP 400 naming them."""
    from fastapi import HTTPException

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    checkpoints = model.generation_config  # greedy, pipeline
    first = transformers.GenerationConfig(**{**checkpoints.to_dict(), "max_new_tokens": 6, "temperature": 0.0})
    same = [transformers.GenerationConfig(**{**checkpoints.to_dict(), "max_new_tokens": 9, "eos_token_id": 3}),
            transformers.GenerationConfig(do_sample=False)]  # a request's own JSON leaving the rest unset
    assert [serving_batching.settings_problem(checkpoints, first, c) for c in same] == [None, None]
    sampled = transformers.GenerationConfig(do_sample=True, temperature=0.5)
    assert "do_sample=True (the manager's: False), temperature=0.5 (the manager's: 0.0)" in \
        serving_batching.settings_problem(checkpoints, first, sampled)
    # a checkpoint that leaves do_sample unset (save_pretrained's default) decodes greedily: `temperature: 0` (the
    # request's do_sample=False) asks for what its manager runs (before: "do_sample=False (the manager's: None)")
    unset = transformers.GenerationConfig(pad_token_id=checkpoints.pad_token_id)
    assert serving_batching.settings_problem(unset, unset, transformers.GenerationConfig(do_sample=False)) is None
    # use_weighted_exit=False asks for no exit, as unset does (it was refused: "(the manager's: None)"); True differs
    for flag, refused in ((False, False), (True, True)):
        problem = serving_batching.settings_problem(checkpoints, first, transformers.GenerationConfig(
            **{**checkpoints.to_dict(), "use_weighted_exit": flag}))
        assert (problem is not None) == refused and (not refused or "use_weighted_exit=True" in problem)
    if OWN_PROCESS:  # no manager per first request: `serving_engine.LoopBatchingRunner` refuses by the same check
        stops = transformers.GenerationConfig(**{**checkpoints.to_dict(), "stop_strings": ["\n"]})
        assert "stop_strings=" in serving_batching.settings_problem(checkpoints, checkpoints, stops)
        return
    manager = serving_batching.install()()
    try:
        with pytest.raises(HTTPException, match="stop_strings=.* in continuous batching") as refused:
            manager.init_cb(model, transformers.GenerationConfig(**{**checkpoints.to_dict(), "stop_strings": ["\n"]}))
        assert refused.value.status_code == 400 and manager._cb is None
    finally:
        from transformers.cli.serving import utils
        utils.CBGenerateManager = manager.wrapped



@pytest.mark.skipif(not OWN_PROCESS, reason="transformers >= 5.25's continuous-batching runner")
def test_the_runner_forwards_a_request_with_the_managers_settings_and_refuses_others():
    """`serving_engine.LoopBatchingRunner`: a request with the manager's settings passes max_new_tokens and EOS on;
    `--compile`'s static cache, which the server adds to every request, is not the request's; another setting is a
    `ValueError` (the server's HTTP 400) naming it."""
    from hf_loopspec.serving_engine import LoopBatchingRunner

    checkpoints = transformers.GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=0)
    runner = object.__new__(LoopBatchingRunner)  # only the two configs the check reads
    runner.model = types.SimpleNamespace(generation_config=checkpoints)
    runner.manager = types.SimpleNamespace(generation_config=checkpoints,
                                           settings=types.SimpleNamespace(recurrence=None))  # (no Huginn settings)
    request = {"max_new_tokens": 1024, "eos_token_id": 3, "do_sample": False, "temperature": None, "top_k": None,
               "top_p": None}
    assert runner._build_continuous_batching_kwargs(request) == {"max_new_tokens": 1024, "eos_token_id": 3}
    compiled = {**request, "cache_implementation": "static"}
    assert runner._build_continuous_batching_kwargs(compiled) == {"max_new_tokens": 1024, "eos_token_id": 3}
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.3 \(the manager's: "):
        runner._build_continuous_batching_kwargs({**request, "repetition_penalty": 1.3})


@pytest.mark.skipif(not OWN_PROCESS, reason="transformers >= 5.25's continuous-batching runner")
def test_the_runner_reads_a_huginn_request_against_the_managers_recurrence():
    """A Huginn-family manager's recurrence settings are what its checkpoint leaves unset means: a request restating
    them joins (before: refused, "num_steps=4 (the manager's: None)"), another num_steps is refused naming both, and
    the request's own `init_seed` keys its initial states (`add_request(init_seed=...)`), as `generate` takes it."""
    from hf_loopspec.models.huginn.recurrence import Recurrence
    from hf_loopspec.serving_engine import LoopBatchingRunner

    checkpoints = transformers.GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=2)
    runner = object.__new__(LoopBatchingRunner)  # only the configs and settings the check reads
    runner.model = types.SimpleNamespace(generation_config=checkpoints)
    recurrence = Recurrence(num_steps=4, init_scale=1.0, init_seed=None)
    runner.manager = types.SimpleNamespace(generation_config=checkpoints,
                                           settings=types.SimpleNamespace(recurrence=recurrence))
    request = {"max_new_tokens": 8, "eos_token_id": 2, "do_sample": False, "temperature": None, "top_k": None,
               "top_p": None}
    passed = {"max_new_tokens": 8, "eos_token_id": 2}
    for restated in ({}, {"num_steps": 4}, {"init_scale": 1.0}, {"num_steps": 4, "init_scale": 1.0}):
        assert runner._build_continuous_batching_kwargs({**request, **restated}) == passed, restated
    with pytest.raises(ValueError, match=r"num_steps=3 \(the manager's: 4\).*may change only max_tokens, its EOS "
                                         r"and seed \(and its init_seed\)"):
        runner._build_continuous_batching_kwargs({**request, "num_steps": 3})
    with pytest.raises(ValueError, match=r"num_steps=4.0 must be an integer >= 1"):  # (equal to 4: it passed)
        runner._build_continuous_batching_kwargs({**request, "num_steps": 4.0})
    assert runner._build_continuous_batching_kwargs({**request, "init_seed": 5}) == {**passed, "init_seed": 5}
    with pytest.raises(ValueError, match=r"init_seed=-1 must be an integer in \[0, 2\*\*64\)"):
        runner._build_continuous_batching_kwargs({**request, "init_seed": -1})


@pytest.mark.skipif(not OWN_PROCESS, reason="transformers >= 5.25's runner")
def test_the_runner_gives_a_request_the_seeds_drawn_from_its_own_seed():
    """A request's `seed` becomes its own seeds (`add_request` keys), equal for equal seeds: transformers' runner
    seeded torch's global generator instead, from which the manager's thread drew every unseeded request's seed
    later, so that requests in flight together took each other's draws. A sampling manager takes a sampling seed, a
    Huginn manager with random initial states and no seed of its own an `init_seed`; a greedy Ouro one neither."""
    from hf_loopspec.models.huginn.recurrence import Recurrence
    from hf_loopspec.serving_engine import LoopBatchingRunner

    checkpoints = transformers.GenerationConfig(max_new_tokens=20, do_sample=True, eos_token_id=0)
    added = []
    runner = object.__new__(LoopBatchingRunner)  # what the runner's `generate` reads, around a recording manager
    runner.model = types.SimpleNamespace(generation_config=checkpoints)
    runner.lock, runner.active_requests, runner.count_tokens = threading.Lock(), {}, lambda **counts: None
    runner._fail_if_worker_died = lambda request_id: False
    request = {"max_new_tokens": 8, "eos_token_id": 0, "do_sample": True, "temperature": None, "top_k": None,
               "top_p": None}

    def sent(settings, seed):
        def add_request(ids, **kwargs):
            added.append({key: kwargs[key] for key in ("seed", "init_seed") if key in kwargs})

        runner.manager = types.SimpleNamespace(generation_config=checkpoints, settings=settings,
                                               add_request=add_request)
        runner.generate(len(added), {"input_ids": [5, 6]}, {**request, "seed": seed}, False)
        return added[-1]

    def settings(do_sample, recurrence=None):
        return types.SimpleNamespace(do_sample=do_sample, recurrence=recurrence, eos_token_id=(0,), vocab=100,
                                     positions=64, pool=types.SimpleNamespace(pages_for=lambda n: 1, pages=8))

    sampling = settings(True)
    assert sent(sampling, 7) == sent(sampling, 7) != sent(sampling, 8)
    assert set(sent(sampling, 7)) == {"seed"} and sent(sampling, None) == {}
    random_states = settings(False, Recurrence(num_steps=4, init_scale=1.0, init_seed=None))
    assert set(sent(random_states, 7)) == {"init_seed"} and sent(random_states, 7) == sent(random_states, 7)
    assert sent(settings(False, Recurrence(num_steps=4, init_scale=1.0, init_seed=3)), 7) == {}
    assert sent(settings(False), 7) == {}


@pytest.mark.skipif(not OWN_PROCESS, reason="transformers >= 5.25's model process")
def test_the_model_process_gets_the_servers_threads():
    """`serving_engine.LoopModelLoader` records the torch threads `serving.start` set (`--threads`) when `Serve`
    builds it, and carries them, pickled, to the model's process."""
    from hf_loopspec.serving_engine import LoopModelLoader

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        loader = LoopModelLoader(device="cpu")
    finally:
        torch.set_num_threads(before)
    assert pickle.loads(pickle.dumps(loader)).threads == 3

@pytest.mark.parametrize(("body", "message"), [
    ({"max_tokens": 1.5}, r"max_tokens=1.5 must be a whole number >= 1"),
    ({"max_tokens": "5"}, r"max_tokens='5' must be"),
    ({"max_completion_tokens": 0}, r"max_completion_tokens=0 must be"),
    ({"max_output_tokens": True}, r"max_output_tokens=True must be"),
    ({"n": 3}, r"n=3 is not supported: this server returns one choice per request"),
    ({"best_of": 2}, r"best_of=2 is not supported"),
    ({"logprobs": True}, r"logprobs=True is not supported: this server returns no log-probabilities"),
    ({"logprobs": 0}, r"logprobs=0 is not supported"),  # the legacy API's 0 still asks for the sampled token's
    ({"top_logprobs": 2}, r"top_logprobs=2 is not supported"),
    ({"echo": True}, r"echo=True is not supported: this server does not echo the prompt"),
    ({"presence_penalty": 0.5}, r"presence_penalty=0.5 is not supported: .*frequency_penalty"),
    ({"suffix": "!"}, r"suffix='!' is not supported"),
    ({"tools": [{"type": "function"}]}, r"tools=.* is not supported"),
    # tool and audio fields transformers' handlers dropped without a word (the answer was ordinary text)
    ({"tool_choice": "required"}, r"tool_choice='required' is not supported: this server does not call tools"),
    ({"tool_choice": {"type": "function", "name": "f"}}, r"tool_choice=.* is not supported"),
    ({"functions": [{"name": "f"}]}, r"functions=.* is not supported: this server does not call functions"),
    ({"function_call": {"name": "f"}}, r"function_call=.* is not supported"),
    ({"modalities": ["text", "audio"]}, r"modalities=.* is not supported: this server answers in text only"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, r"audio=.* is not supported"),
    ({"seed": 1.5}, r"seed=1.5 must be a whole number in \[-9223372036854775808, 18446744073709551615\] "
                    r"\(transformers would cut it to 1\)\.$"),
    ({"seed": 2.5}, r"seed=2.5 .*\(transformers would cut it to 2\)\.$"),  # (every note said "cut 1.5 to 1")
    ({"seed": "7"}, r"seed='7' must be a whole number in \[[-0-9, ]+\]\.$"),
    ({"seed": True}, r"seed=True must be a whole number in \[[-0-9, ]+\]\.$"),
    ({"seed": 2**64}, r"seed=18446744073709551616 must be"),  # (torch's generator raised: a bare 500)
    ({"response_format": {"type": "json_object"}}, r"response_format=.* is not supported"),
    # values transformers' handlers failed on with a bare 500, or took out of range
    ({"prompt": "Hi\ud800"}, r"not valid Unicode \(surrogates not allowed: '\\ud800'\)"),
    ({"stop": 5}, r"stop=5 must be a non-empty string or a list of them"),
    ({"stop": ""}, r"stop='' must be"),
    ({"messages": "hello"}, r"messages='hello' must be a list of messages"),
    ({"generation_config": {"do_sample": False}}, r"generation_config=\{'do_sample': False\} must be a JSON object "
                                                   "written as a string"),
    ({"generation_config": "[1, 2]"}, r"generation_config='\[1, 2\]' must be"),
    ({"stream": "yes"}, r"stream='yes' must be true or false"),  # (it streamed: transformers took it as true)
    ({"temperature": -1}, r"temperature=-1 must be a number in \[0, 2\]"),
    ({"top_p": 2.0}, r"top_p=2.0 must be a number in \[0, 1\]"),
    # dropped by the handlers (null: the checkpoint's speculative mode decoded), a sequence lost, a 500 after decoding
    ({"generation_config": '{"speculative_mode": null}'}, r"generation_config's speculative_mode=null is not passed"),
    ({"generation_config": '{"num_return_sequences": 2, "do_sample": true}'},
     r"num_return_sequences=2 is not supported: this server returns one sequence"),
    ({"generation_config": '{"return_dict_in_generate": true}'}, r"return_dict_in_generate=True is not supported"),
])
def test_a_request_field_the_server_cannot_honour_is_refused(body, message):
    assert re.search(message, serving_requests.request_problem({"prompt": "x", **body}))


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/chat/completions", {}, r"messages is missing: a request to /v1/chat/completions needs its messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, r"messages=.* must be a list of messages, each "
                                                                  "with its role"),
    ("/v1/responses", {"input": None}, r"input is missing: a request to /v1/responses needs its input"),
    ("/v1/completions", {}, r"prompt is missing: a request to /v1/completions needs its prompt"),  # (said input_ids=[])
    ("/v1/responses", {"input": 5}, r"input=5: give a string, or a list that starts with a message"),
    ("/v1/responses", {"input": [{"content": "hi"}]}, r"input=.*: give a string"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"text": "hi"}]}]}, r"input=.*: give a string"),
    # transformers reads a list whose first item is no message as one message's parts (it failed on the message)
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "hi"}]},
     r"a list that starts with no message is read as one user message's text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
     r"messages=.* its content as text or text parts"),
    # messages the chat template got as they were (an answer to a conversation the client did not send)
    *(("/v1/chat/completions", {"messages": [message]}, r"messages=.* each with its role and its content")
      for message in ({"role": "user"}, {"role": "user", "content": None}, {"role": 5, "content": "x"},
                      {"role": "assistant", "content": None})),
    *(("/v1/responses", {"input": [message]}, r"input=.*: give a string, or a list that starts with a message")
      for message in ({"role": "user"}, {"role": 5, "content": "x"}, {"role": "user", "content": None})),
    # the Responses API's system message, which the handler failed on with a bare 500
    *(("/v1/responses", {"input": "hi", "instructions": value}, r"instructions=.* must be a string")
      for value in (5, ["a"], {"a": 1})),
    # content transformers' handlers failed on with a bare 500 (a dict, a number, a text part without its text)
    *(("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}, r"messages=.* text parts")
      for content in ({"type": "text", "text": "hi"}, 5, [{"type": "text"}], [{"type": "text", "text": 5}])),
    # parts the handlers dropped without a word: the models read text only
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]},
     r"messages=.*: the model reads text only"),
    ("/v1/responses", {"input": [{"type": "input_text", "text": "hi"}, {"type": "input_audio", "data": "AA"}]},
     r"input=.*: the model reads text only"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}},
     r"text.format=\{'type': 'json_object'\} is not supported: this server does not constrain"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"},
     r"previous_response_id='resp_1' is not supported: this server keeps no responses"),
    ("/v1/responses", {"input": "hi", "include": ["message.output_text.logprobs"]},
     r"include=.* is not supported: this server returns no log-probabilities"),
])
def test_what_a_handler_needs_or_would_drop_is_refused(path, body, message):
    """A chat request without messages (or a message without its role) and a Responses request without input
    failed in transformers' handlers with a bare HTTP 500; the Responses API's output format, earlier response and
    extra output were dropped with only a line in the server's log."""
    assert re.search(message, serving_requests.request_problem(body, path=path))
    fine = {"/v1/chat/completions": [{"messages": [{"role": "user", "content": "hi"}]},
                                     {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}],
            "/v1/responses": [{"input": "hi", "text": {"format": {"type": "text"}}, "include": [],
                               "instructions": "Be brief."},
                              {"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                                         {"role": "user", "content": "why?"}]},
                              {"input": [{"type": "input_text", "text": "hi"}]},
                              {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                         {"role": "assistant", "content": "hello"}]}],
            "/v1/completions": [{"prompt": "hi"}, {"prompt": ""}]}[path]
    assert [serving_requests.request_problem(body, path=path) for body in fine] == [None] * len(fine)


def test_a_token_limit_that_reaches_the_models_positions_is_refused():
    """Transformers' loop would warn in the server's log and decode past the positions for as long as the client
    waits; a limit below them passes (whether the prompt leaves room is `generate`'s to say)."""
    assert re.search(r"max_completion_tokens=2048 reaches the model's 2048 positions, .*fewer than 2048 minus",
                     serving_requests.request_problem({"prompt": "x", "max_completion_tokens": 2048}, positions=2048))
    assert serving_requests.request_problem({"prompt": "x", "max_tokens": 2047}, positions=2048) is None
    assert serving_requests.request_problem({"prompt": "x", "max_tokens": 10**6}) is None  # positions unknown
    # the same limits given in the generation config (they bypassed the check: a request decoded 2,100 tokens past
    # the 2,048 positions, or for as long as the client waited)
    for value, refused in ((2048, True), (2047, False)):
        body = {"prompt": "x", "generation_config": json.dumps({"max_new_tokens": value})}
        problem = serving_requests.request_problem(body, positions=2048)
        assert (problem is not None) == refused, value
        assert not refused or f"generation_config's max_new_tokens={value} goes past the model's 2048" in problem
    # a limit that does not apply is not checked: max_tokens replaces the config's max_new_tokens
    assert serving_requests.request_problem({"prompt": "x", "max_tokens": 10, "generation_config": json.dumps(
        {"max_new_tokens": 5000})}, positions=2048) is None
    # the server always sets max_new_tokens, which wins over a max_length: one was ignored without a word (a
    # request asking for 6 positions decoded 146 tokens), or made continuous batching refuse the 1024 tokens of
    # the server's default, which the client never asked for
    for settings in ({"max_length": 6}, {"max_length": 5000}, {"max_new_tokens": 10, "max_length": 5000}):
        problem = serving_requests.request_problem({"prompt": "x", "generation_config": json.dumps(settings)})
        assert re.search(r"max_length=\d+ is not honoured .* send max_tokens", problem), settings
    responses = serving_requests.request_problem({"input": "x", "generation_config": json.dumps({"max_length": 6})},
                                                 path="/v1/responses")  # (its field: max_tokens gets a 422 there)
    assert "send max_output_tokens, or generation_config's max_new_tokens" in responses


@pytest.mark.parametrize("body", [
    {"prompt": "x"}, {"prompt": "x", "max_tokens": 8, "n": 1, "logprobs": False, "echo": False},
    {"max_tokens": None, "n": None, "logprobs": None, "presence_penalty": 0, "top_logprobs": 0, "best_of": 1},
    {"stop": ["\n", "#"], "tools": [], "response_format": {"type": "text"}, "suffix": None, "temperature": 0,
     "top_p": 1, "generation_config": '{"speculative_mode": "pipeline"}',
     "messages": [{"role": "user", "content": "x"}]},
    {"tool_choice": "auto", "function_call": "none", "functions": [], "modalities": ["text"], "seed": -1},
    {"seed": 2**64 - 1, "audio": None},
    ["not", "an", "object"],
])
def test_defaults_and_unset_fields_pass(body):
    assert serving_requests.request_problem(body) is None
