"""`hf-loopspec serve`'s own reading of a request and of its answer: fields OpenAI's API takes that the server cannot
honour as given are refused with a 400 naming them (`serving_requests`), and a chat or completions answer ends
before its first stop string, streaming or not (`serving_stops`), as OpenAI's API returns it; on a stand-in for
transformers' app (exact texts and events) and on the served embedded model."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request

import pytest
import test_serve
import torch
from test_serve import post, stand_in_served, start_server
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import hf_loopspec
from hf_loopspec import serving_requests, serving_responses
from hf_loopspec.assets import default_model_path
from hf_loopspec.serving_stops import StopCut, served_class, stop_at, stop_strings

checkpoint = test_serve.checkpoint  # (the served copy of the embedded model, with a chat template)
PENALTY = r"frequency_penalty=%s must be a number above -1 and at most 2: .* repetition_penalty = 1 \+ frequency_pen"


@pytest.mark.parametrize(("value", "shown"), [
    ("a", "'a'"), ("1.5", "'1.5'"), (True, "True"),  # (a string failed in float(), or was taken; True as 1)
    (-1.5, "-1.5"), (-1, "-1"),  # in OpenAI's [-2, 2], but repetition_penalty <= 0 (transformers' own 400)
    (float("nan"), "nan"), (float("inf"), "inf"), (2.5, "2.5"),
])
def test_a_frequency_penalty_the_server_cannot_apply_is_refused(value, shown):
    problem = serving_requests.request_problem({"prompt": "x", "frequency_penalty": value}, path="/v1/completions")
    assert re.search(PENALTY % re.escape(shown), problem), problem
    assert "pass a number in (-1, 2]" in problem


@pytest.mark.parametrize("value", [-0.5, 0, 1.5, 2, None])
def test_a_frequency_penalty_in_range_passes(value):
    assert serving_requests.request_problem({"prompt": "x", "frequency_penalty": value}) is None


@pytest.mark.parametrize(("prompt", "kind"), [
    (["def a():", "def b():"], "a list of strings"), ([100, 200, 300], "a list of token ids"),
    ([[100, 200]], "a list of token-id lists"), ([], "a value of type list"), (5, "a value of type int"),
])
def test_a_prompt_that_is_not_one_string_is_refused(prompt, kind):
    """OpenAI takes several prompts, or tokens, in a list; transformers' handler answered a bare "prompt must be a
    string."."""
    problem = serving_requests.request_problem({"prompt": prompt}, path="/v1/completions")
    assert problem.startswith(f"prompt={prompt!r} is {kind}: this server takes one prompt per request, as a string")
    assert "send one request per prompt" in problem


@pytest.mark.parametrize(("options", "message"), [
    ({"include_usage": "x"}, r"stream_options.include_usage='x' must be true or false"),  # (taken as true)
    ({"include_usage": 1}, r"stream_options.include_usage=1 must be true or false"),
    ("yes", r"stream_options='yes' must be an object"),
])
def test_stream_options_that_are_no_object_of_bools_are_refused(options, message):
    body = {"prompt": "x", "stream": True, "stream_options": options}
    assert re.search(message, serving_requests.request_problem(body))
    for fine in ({"include_usage": True}, {"include_usage": False}, {}, None):
        assert serving_requests.request_problem({**body, "stream_options": fine}) is None


def test_a_pool_refusal_names_the_servers_options_not_the_librarys_calls():
    """A continuous-batching manager's refusal of a request its pool cannot hold named
    `ContinuousBatchingConfig(num_blocks=...)`, `persistent_manager=True` and
    `model.destroy_cached_continuous_batching_manager()`, which neither a client nor the server's operator can use."""
    from types import SimpleNamespace

    from hf_loopspec.generation.continuous import settings

    pool = SimpleNamespace(pages=4, planes=2, positions=32, pages_for=lambda positions: 2 * -(-positions // 16))
    manager = SimpleNamespace(vocab=100, positions=2048, pool=pool)
    refusal = settings.request_problem(manager, [1, 2, 3], 130, [], {})
    assert "ContinuousBatchingConfig(num_blocks=...)" in refusal  # (the library's advice, in a Python call)
    served = serving_requests.served_advice(refusal)
    assert served.startswith(refusal[:refusal.index(": shorten")]) and served.endswith(
        ": send a shorter prompt or a smaller max_tokens (without it, max_new_tokens is the server's default), or "
        "restart the server with a larger --cb-num-blocks (--cb-max-memory-percent when memory caps the pool)."), served
    assert serving_requests.served_advice("max_tokens=0 must be") == "max_tokens=0 must be"  # (others as they are)


def test_refusals_a_request_cannot_follow_say_what_it_can_do():
    """An empty completion prompt (the embedded tokenizer adds no BOS token) was refused as "input_ids has no tokens"
    by generate and as "input_ids=[]: give a non-empty list of token ids" by continuous batching, where the client sent
    no input_ids; an unknown speculative_mode was told to use None, which no request can send."""
    from hf_loopspec.generation.config import resolve_speculative
    from hf_loopspec.generation.continuous import settings

    model, refusals = AutoModelForCausalLM.from_pretrained(default_model_path()), []
    for call in (lambda: model.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=2),
                 lambda: resolve_speculative("plain", num_loops=4)):
        with pytest.raises(ValueError) as raised:
            call()
        refusals.append(str(raised.value))
    refusals.append(settings.request_problem(None, [], 4, [], {}))  # (the first check: no manager setting read)
    empty = ("prompt is empty once tokenized (this model's tokenizer adds no BOS token), and the first generated "
             "token needs a context: send a prompt of at least one token.")
    assert serving_requests.served_advice(refusals[0]) == serving_requests.served_advice(refusals[2]) == empty
    plain = serving_requests.served_advice(refusals[1])
    assert plain.startswith(refusals[1]) and "cannot set speculative_mode=None: leave speculative_mode out" in plain


def test_a_streams_texts_keep_out_what_could_still_be_a_stop_string():
    """Whatever the pieces a text comes in, the pieces sent hold no stop text and join to the text cut before the
    first stop string to appear in it (the one that ends first), as the answer without streaming is cut."""
    cases = [("x = vmod(a)\n", ("(", "mod(q")), ("abcd", ("abcd", "c")), ("abab", ("bab", "aba")), ("ab", ("b(",)),
             ("", ("(",)), ("a((b", ("((",))]
    for text, stops in cases:
        want = text[:stop_at(text, stops)] if stop_at(text, stops) is not None else text
        for size in (1, 2, 3, len(text) or 1):
            cut = StopCut(stops)
            sent = [cut.feed(text[i:i + size]) for i in range(0, len(text), size)] + [cut.rest()]
            assert "".join(sent) == want, (text, stops, size)
            assert not any(stop in piece for piece in sent for stop in stops), (text, stops, size)
    assert [stop_at(text, stops) for text, stops in cases] == [8, 2, 0, None, None, 1]


# (stop strings, the text the stand-in handler answers, the pieces its stream sends, the answer's finish_reason)
STAND_IN = [(["(", "mod(q"], "x = vmod(a)\n", ["x = ", "vm", "od", "(a", ")", "\n"], "stop"),
            ("mod(q", "x = vmod", ["x = ", "vm", "od"], "length")]  # the held-back "mod" ends the stream


def stand_in_app(stops: list | str, text: str, pieces: list[str]):
    """A stand-in for transformers' app: /v1/completions and /v1/chat/completions answer `text` (finish_reason
    "length", as when the token limit and the stop string come at once), or stream `pieces`, some events sent
    together and one split across chunks, then the finish and usage events, as transformers' handlers do."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    def event(choice: dict) -> bytes:
        return f"data: {json.dumps({'id': 'r', 'choices': [{'index': 0, **choice}], 'usage': None})}\n\n".encode()

    async def answer(request: Request):
        body = await request.json()
        assert body.get("stop") == stops  # (what transformers reads: its own stop_strings stop the generation)
        chat = request.url.path.endswith("/chat/completions")
        if not body.get("stream"):
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return JSONResponse({"choices": [{"index": 0, **choice, "finish_reason": "length"}], "usage": {}})
        own = [{"delta": {"content": piece}} if chat else {"text": piece} for piece in pieces]
        events = [event(choice) for choice in own]
        events += [event({"delta": {}, "finish_reason": "length"} if chat else {"text": "", "finish_reason": "length"}),
                   b'data: {"id": "r", "choices": [], "usage": {"completion_tokens": 6}}\n\n']
        if chat:
            events.insert(0, event({"delta": {"role": "assistant"}}))
        together = b"".join(events[:2])
        chunks = [together[:-7], together[-7:], *events[2:]]  # (an event split across chunks)
        return StreamingResponse(iter(chunks), media_type="text/event-stream")

    app = FastAPI()
    for path in ("/v1/completions", "/v1/chat/completions"):
        app.router.add_route(path, answer, methods=["POST"])
    return app


def streamed(base: str, endpoint: str, body: dict) -> list[bytes]:
    """The server-sent events (without their blank lines) of a streaming POST of `body`."""
    request = urllib.request.Request(f"{base}{endpoint}", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return [event for event in answer.read().split(b"\n\n") if event]


def texts(events: list[bytes], chat: bool) -> tuple[list[str], list]:
    """`(texts, finish reasons)` of a chat or completions stream's events."""
    choices = [choice for event in events if event.startswith(b"data: {")
               for choice in json.loads(event[len(b"data: "):])["choices"]]
    got = [choice["delta"].get("content") if chat else choice["text"] for choice in choices]
    return [text for text in got if text is not None], [c.get("finish_reason") for c in choices]


@pytest.mark.parametrize(("stops", "text", "pieces", "reason"), STAND_IN)
def test_an_answer_ends_before_its_first_stop_string(monkeypatch, stops, text, pieces, reason):
    """transformers' handlers returned the stop string and what its token carried after it ("x = vmod(a)"); the
    answer ends before it, finish_reason "stop", and no streamed event holds stop text, its texts joined equal to the
    answer without streaming (text that could begin a stop string is held back, and sent when it is not one)."""
    with stand_in_served(monkeypatch, stand_in_app(stops, text, pieces)) as port:
        base = f"http://127.0.0.1:{port}/v1/"
        client = type("Client", (), {"base_url": base})
        for endpoint, chat, body in (("completions", False, {"prompt": "x = foo"}),
                                     ("chat/completions", True, {"messages": [{"role": "user", "content": "x"}]})):
            status, answer = post(client, endpoint, json.dumps({**body, "stop": stops}).encode(), "application/json")
            choice = answer["choices"][0]
            assert status == 200 and (choice["message"]["content"] if chat else choice["text"]) == "x = vmod"
            assert choice["finish_reason"] == reason
            events = streamed(base, endpoint, {**body, "stop": stops, "stream": True})
            sent, reasons = texts(events, chat)
            assert "".join(sent) == "x = vmod" and not any("(" in piece or "mod(q" in piece for piece in sent)
            assert reasons[-1] == reason and events[-2:] == [
                b'data: {"id": "r", "choices": [], "usage": {"completion_tokens": 6}}', b"data: [DONE]"]
            assert (events[0] == b'data: {"id": "r", "choices": [{"index": 0, "delta": {"role": "assistant"}}], '
                                 b'"usage": null}') == chat  # (a chat stream's role event, kept)


@pytest.mark.parametrize("source", ["generation_config", "checkpoint"])
def test_stop_strings_from_a_requests_generation_config_or_the_checkpoint_are_kept_out_too(monkeypatch, source):
    """Stop strings that the request's `generation_config` names (`stop_strings`), or without any of the request's
    own the checkpoint's, end the answer as `stop` does: before the first to appear, finish_reason "stop", on both
    endpoints, streaming or not (their answers kept the stop text: "x = vmod(a)\n" for "(")."""
    stops, text, pieces, reason = STAND_IN[0]
    own = {"generation_config": json.dumps({"stop_strings": stops})} if source == "generation_config" else {}
    with stand_in_served(monkeypatch, stand_in_app(None, text, pieces), stops=None if own else stops) as port:
        base = f"http://127.0.0.1:{port}/v1/"
        client = type("Client", (), {"base_url": base})
        message = {"role": "user", "content": "x"}
        for endpoint, chat, body in (("completions", False, {"prompt": "x = foo", **own}),
                                     ("chat/completions", True, {"messages": [message], **own})):
            status, answer = post(client, endpoint, json.dumps(body).encode(), "application/json")
            assert status == 200 and answer_text(answer, chat) == "x = vmod"
            assert answer["choices"][0]["finish_reason"] == reason
            sent, reasons = texts(streamed(base, endpoint, {**body, "stream": True}), chat)
            assert "".join(sent) == "x = vmod" and reasons[-1] == reason


def test_a_requests_stop_strings_are_its_stop_else_its_generation_configs_else_the_checkpoints():
    """The stop strings an answer is cut by are those the served `generate` decodes with (`output_stops`): the
    request's `stop`, else its generation config's `stop_strings`, else the checkpoint's; an empty one names none."""
    config = json.dumps({"stop_strings": ["b"]})
    assert stop_strings({"stop": "a", "generation_config": config}, ["c"]) == ("a",)
    assert stop_strings({"generation_config": config}, ["c"]) == ("b",)
    assert stop_strings({"stop": [], "generation_config": json.dumps({"stop_strings": []})}, "c") == ("c",)
    assert stop_strings({"stop": []}, None) == () and stop_strings({}, []) == ()


@pytest.mark.parametrize("mode", [None, "pipeline"])
def test_the_served_class_judges_stop_strings_on_the_generated_text(mode):
    """`served_class`'s generate, as the handlers call it (stop strings as a keyword, or in the generation config):
    a stop string that begins in the prompt is no stop (transformers' criterion stopped at the token completing it),
    and one in the generated text stops where transformers' own stop strings stop, in every mode."""
    path = hf_loopspec.default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    served = served_class(type(model)).from_pretrained(path)
    ids = tokenizer("def area(radius):\n    return", return_tensors="pt").input_ids
    settings = dict(max_new_tokens=12, do_sample=False, speculative_mode=mode, tokenizer=tokenizer)
    with torch.no_grad():
        full = model.generate(ids, **settings)
        text = tokenizer.decode(full[0, ids.shape[1]:])
        straddle = next("rn" + text[:k] for k in range(1, len(text)) if "rn" + text[:k] not in text)
        at_once = model.generate(ids, stop_strings=straddle, **settings)
        assert at_once.shape[1] == ids.shape[1] + 1  # (transformers' criterion reads the prompt too)
        for given in ({"stop_strings": straddle}, {"generation_config": GenerationConfig(stop_strings=[straddle])}):
            assert torch.equal(served.generate(ids, **given, **settings), full)
        inside = text[4:6]  # a stop in the generated text, not at its start
        want = model.generate(ids, stop_strings=inside, **settings)
        assert want.shape[1] < full.shape[1]
        for given in ({"stop_strings": [inside]}, {"generation_config": GenerationConfig(stop_strings=inside)}):
            assert torch.equal(served.generate(ids, **given, **settings), want)


def test_a_checkpoints_stop_strings_are_judged_on_the_generated_text_and_a_requests_replace_them(tmp_path):
    """A checkpoint whose generation config names stop strings, served: they are judged on the generated text too
    (transformers' criterion stopped at the first token when one began in the prompt), and a request's own stop
    strings replace them (the served class cleared the request's, which transformers then filled from the
    checkpoint's: the request's were lost)."""
    folder = tmp_path / "with-stops"
    shutil.copytree(hf_loopspec.default_model_path(), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("def area(radius):\n    return", return_tensors="pt").input_ids
    settings = dict(max_new_tokens=12, do_sample=False, speculative_mode=None, tokenizer=tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        full = plain.generate(ids, **settings)
        text = tokenizer.decode(full[0, ids.shape[1]:])
        straddle = next("rn" + text[:k] for k in range(1, len(text)) if "rn" + text[:k] not in text)
        inside = text[4:6]
        want = plain.generate(ids, stop_strings=inside, **settings)
        plain.generation_config.stop_strings = [straddle]
        plain.generation_config.save_pretrained(folder)
        served = served_class(type(plain)).from_pretrained(folder)
        assert torch.equal(served.generate(ids, **settings), full)  # the checkpoint's: no stop in the generated text
        assert torch.equal(served.generate(ids, stop_strings=[inside], **settings), want)  # the request's instead
        config = GenerationConfig(stop_strings=[inside], max_new_tokens=12, do_sample=False)  # (5.24's handlers)
        assert torch.equal(served.generate(ids, generation_config=config, tokenizer=tokenizer), want)
        # auto (the embedded model's default): its stretches call generate again, which added the checkpoint's
        # stop strings beside the request's (a checkpoint's stop string early in the text ended it there)
        served.checkpoint_stops = [text[:2]]
        late = served.generate(ids, stop_strings=[text[-2:]], **settings)  # (plain: no inner call)
        assert late.shape[1] > ids.shape[1] + 2
        assert torch.equal(served.generate(ids, stop_strings=[text[-2:]], **{**settings, "speculative_mode": "auto"}),
                           late)
    # a continuous-batching manager, which stops at EOS and max_new_tokens only, still refuses them (it ran past them)
    with pytest.raises(ValueError, match=r"names stop_strings=\[' _'\], but a continuous-batching manager .* "
                                         r"serve it without --continuous-batching"):
        served.init_continuous_batching()
    with pytest.raises(ValueError, match="generation_config: a dict"):  # (the manager's own refusal, not an error)
        served.init_continuous_batching({"max_new_tokens": 5})


def test_a_responses_answer_cut_by_its_token_limit_is_incomplete(checkpoint):
    """transformers' /v1/responses handler called every answer "completed"; one that reached max_output_tokens is
    "incomplete" with incomplete_details.reason "max_output_tokens", as OpenAI's API answers it, and its stream ends
    with a response.incomplete event (read through the `openai` client)."""
    server, client, _, patch = start_server(checkpoint)
    try:
        answer = client.responses.create(model=checkpoint, input="hi", max_output_tokens=3, temperature=0)
        assert (answer.status, answer.incomplete_details.reason, answer.usage.output_tokens) == \
            ("incomplete", "max_output_tokens", 3)
        assert [item.status for item in answer.output if item.type == "message"] == ["incomplete"]
        events = list(client.responses.create(model=checkpoint, input="hi", max_output_tokens=3, temperature=0,
                                              stream=True))
        assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
        assert events[-1].response.output[-1].content[0].text == answer.output[-1].content[0].text
    finally:
        server.kill_server()
        patch.undo()


def test_the_responses_status_follows_the_limit_a_request_sets_or_the_servers():
    """The limit: max_output_tokens, else the generation_config's max_new_tokens, else the server's (the checkpoint's
    max_new_tokens, at least 1024, as transformers' handlers set it); an answer under it stays "completed"."""
    assert serving_responses.token_limit({"input": "x", "max_output_tokens": 5}, 1024) == 5
    assert serving_responses.token_limit({"input": "x", "generation_config": '{"max_new_tokens": 7}'}, 1024) == 7
    assert serving_responses.token_limit({"input": "x"}, 2000) == 2000
    assert [serving_responses.default_limit(GenerationConfig(max_new_tokens=n)) for n in (None, 20, 4096)] == \
        [1024, 1024, 4096]
    answer = {"status": "completed", "usage": {"output_tokens": 4}, "output": [{"type": "message", "status":
                                                                                  "completed"}]}
    assert serving_responses.with_limit_status(dict(answer), 5)["status"] == "completed"
    event = serving_responses.with_event_status({"type": "response.completed", "response": answer}, 4)
    assert (event["type"], event["response"]["incomplete_details"]) == ("response.incomplete",
                                                                         {"reason": "max_output_tokens"})


def test_the_served_model_answers_without_its_stop_string(checkpoint):
    """The embedded model, served: a request with a stop string taken from its own greedy answer (12 tokens) gets
    that answer cut before the stop string's first occurrence, on both endpoints, streaming (no event with stop text)
    or not; a stop string that begins in the prompt and ends in the answer is no stop (OpenAI's API judges the
    generated text: transformers' criterion ended the answer at its first token)."""
    server, client, _, patch = start_server(checkpoint)
    try:
        for endpoint, chat in (("completions", False), ("chat/completions", True)):
            body = {"messages": [{"role": "user", "content": "x = foo"}]} if chat else {"prompt": "x = foo"}
            body.update(max_tokens=12, temperature=0)
            full = answer_text(post(client, endpoint, json.dumps(body).encode(), "application/json")[1], chat)
            # the stop string: the latest two characters of the answer that appear there first
            at = max(k for k in range(1, len(full) - 1) if full.index(full[k:k + 2]) == k)
            stop, want = full[at:at + 2], full[:at]
            status, answer = post(client, endpoint, json.dumps({**body, "stop": stop}).encode(), "application/json")
            assert status == 200 and answer_text(answer, chat) == want, (full, stop, answer)
            assert answer["choices"][0]["finish_reason"] == "stop"
            sent, reasons = texts(streamed(str(client.base_url), endpoint, {**body, "stop": [stop], "stream": True}),
                                  chat)
            assert "".join(sent) == want and not any(stop in piece for piece in sent), (full, stop, sent)
            assert reasons[-1] == "stop"
            if not chat:  # the prompt's last characters and the answer's first: in neither alone
                straddle = next(body["prompt"][-2:] + full[:k] for k in range(1, len(full))
                                if body["prompt"][-2:] + full[:k] not in full)
                status, answer = post(client, endpoint, json.dumps({**body, "stop": straddle}).encode(),
                                      "application/json")
                assert status == 200 and answer_text(answer, chat) == full, (full, straddle, answer)
                assert answer["choices"][0]["finish_reason"] == "length"
    finally:
        server.kill_server()
        patch.undo()


def answer_text(answer: dict, chat: bool) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]
