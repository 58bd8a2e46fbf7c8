"""What a request to `hf-loopspec serve` may hold: the checks the server runs on a completion request's JSON body
before transformers' handlers read it (`request_problem`, `value_problem`), and the rewrites of OpenAI's values into
the forms those handlers take (`as_transformers_reads`). `serving.openai_errors` applies both to every POST to
those endpoints (`body_problem`)."""

from __future__ import annotations

import json
import math
import reprlib

from .serving_responses import token_limit
from .serving_stops import stop_strings

GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # the endpoints whose bodies are checked
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})  # the content part types of text (chat, Responses)
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
ONE_ANSWER = {  # request fields the server cannot honour (transformers logs them as ignored), and the fix
    "n": (1, "this server returns one choice per request; send that many requests"),
    "best_of": (1, "this server returns one choice per request; send that many requests"),
    "logprobs": (False, "this server returns no log-probabilities; leave it out (or call model.generate with "
                        "output_scores=True)"),
    "top_logprobs": (0, "this server returns no log-probabilities; leave it out"),
    "echo": (False, "this server does not echo the prompt; prepend it yourself"),
    "presence_penalty": (0, "this server has no presence penalty; use frequency_penalty (a repetition penalty)"),
}


UNSUPPORTED = {  # request fields transformers' handlers would drop without a word, when set to anything but these
    "suffix": ((None, ""), "this server does not insert a suffix; append it yourself"),
    "tools": ((None, []), "this server does not call tools; leave them out"),
    "tool_choice": ((None, "none", "auto"), "this server does not call tools; leave it out"),
    "functions": ((None, []), "this server does not call functions; leave them out"),
    "function_call": ((None, "none", "auto"), "this server does not call functions; leave it out"),
    "modalities": ((None, ["text"]), "this server answers in text only; leave it out"),
    "audio": ((None,), "this server answers in text only; leave it out"),
    "response_format": ((None, {"type": "text"}), "this server does not constrain the output's format; leave it out"),
    "previous_response_id": ((None,), "this server keeps no responses; send the whole conversation as input"),
    "include": ((None, []), "this server returns no log-probabilities nor other extra output; leave it out"),
}
SETTINGS_ANSWERED = {  # generation_config settings whose other values the handlers cannot answer, and the fix
    "num_return_sequences": (1, "this server returns one sequence per request (the others were lost); send that "
                                "many requests"),
    "return_dict_in_generate": (False, "this server reads the sequences alone (the handlers failed after decoding); "
                                       "leave it out"),
}
REQUIRED = {  # what those handlers read unchecked (a bare 500 without it)
    "/chat/completions": ("messages", 'a list of messages, {"role": ..., "content": ...}'),
    "/responses": ("input", "a string or a list of items (messages, content parts)"),
    "/completions": ("prompt", "the text to continue"),  # (after /chat/completions: the first ending that matches)
}
SEEDS = (-(2**63), 2**64 - 1)  # the seeds torch's generators take


def request_problem(body, positions: int | None = None, path: str = "") -> str | None:
    """Why the server refuses a completion request's JSON `body` before transformers reads it, or None: a token limit
    that is not a whole number >= 1 (transformers would take 1.5 as 1 and "5" as 5) or that alone reaches the model's
    `positions` (transformers would warn in the server's log and decode on past them, for as long as the client
    waits; the generation config's `max_new_tokens` likewise), the generation config's `max_length` (the server
    always sets `max_new_tokens`, which wins over it: it would be ignored), a field it would ignore with a
    warning in the server's log only (`ONE_ANSWER`: `n=2` would return one choice) or without one (`UNSUPPORTED`), or
    a value its handlers would fail on with a bare 500 (`value_problem`), or a `logit_bias` sent to `path`
    /v1/completions, whose handler drops it without a word (chat's takes it). Null counts as unset."""
    if not isinstance(body, dict):
        return None
    problem = value_problem(body)
    if problem:
        return problem
    name, what = next((required for end, required in REQUIRED.items() if path.endswith(end)), (None, None))
    if name and body.get(name) is None:
        return f"{name} is missing: a request to {path} needs its {name} ({what})."
    text_format = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if text_format not in (None, {"type": "text"}):  # the Responses API's response_format
        return f"text.format={text_format!r} is not supported: this server does not constrain the output's format."
    if body.get("logit_bias") and path.endswith("/completions") and not path.endswith("/chat/completions"):
        return ("logit_bias is not supported on /v1/completions (its handler would drop it); send the request to "
                "/v1/chat/completions, or leave logit_bias out.")
    for name in TOKEN_LIMITS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{name}={value!r} must be a whole number >= 1 (the most tokens to generate), or left out."
        if value is not None and positions is not None and value >= positions:
            return (f"{name}={value} reaches the model's {positions} positions, which the prompt's tokens share; "
                    f"ask for fewer than {positions} minus the prompt's length.")
    settings = json.loads(body["generation_config"]) if isinstance(body.get("generation_config"), str) else {}
    if settings.get("max_length") is not None:  # (a JSON object: `value_problem`)
        limit = "max_output_tokens" if path.endswith("/responses") else "max_tokens"  # (the endpoint's own field)
        return (f"generation_config's max_length={settings['max_length']!r} is not honoured by this server: it always "
                f"sets max_new_tokens ({limit}, else the checkpoint's, at least 1024), which wins over max_length; "
                f"send {limit}, or generation_config's max_new_tokens, instead.")
    if nulls := [key for key, value in settings.items() if value is None]:  # (the handlers pass set values only)
        return (f"generation_config's {nulls[0]}=null is not passed on by this server (transformers' handlers drop "
                f"unset values, so the checkpoint's {nulls[0]} would apply without a word): leave it out, or give a "
                "value.")
    for name, (default, fix) in SETTINGS_ANSWERED.items():
        if settings.get(name, default) != default:
            return f"generation_config's {name}={settings[name]!r} is not supported: {fix}."
    value = settings.get("max_new_tokens")  # the limit that applies unless max_tokens or the like replace it
    if positions is not None and all(body.get(name) is None for name in TOKEN_LIMITS) and isinstance(
            value, (int, float)) and not isinstance(value, bool) and value >= positions:
        return (f"generation_config's max_new_tokens={value} goes past the model's {positions} positions, which the "
                "prompt's tokens share; ask for fewer tokens (generation_config's max_new_tokens, or max_tokens).")
    for name, (default, fix) in ONE_ANSWER.items():
        value = body.get(name)
        kept = value is default if isinstance(default, bool) else not isinstance(value, bool) and value == default
        if value is not None and not kept:
            return f"{name}={value!r} is not supported: {fix}."
    for name, (defaults, fix) in UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            return f"{name}={body[name]!r} is not supported: {fix}."
    return None


async def body_problem(request, positions: int | None, limit: int, stops=None) -> str | None:
    """Why a POST's JSON body to a generating endpoint (`GENERATING`) is refused (`request_problem`, for a model of
    `positions` positions; a body that is not JSON, or nests too deeply), or None, after giving the request the body
    transformers reads (`as_transformers_reads`), its stop strings, `request.state.stops` (`serving_stops`; `stops`: the
    checkpoint's, for a request without its own), and for /v1/responses its token limit, `request.state.limit`
    (`serving_responses`; `limit` when it sets none). Other endpoints' bodies (/v1/systemone's, whose schema forbids
    fields it does not name, /load_model's) go to their handlers as sent."""
    if request.method != "POST" or "json" not in request.headers.get("content-type", "").lower() \
            or request.url.path.rstrip("/") not in GENERATING:
        return None
    try:
        body = json.loads(await request.body())
        problem = request_problem(body, positions, request.url.path)
    except RecursionError:
        return "the request body nests too deeply."
    except ValueError as error:
        return f"the request body is not valid JSON ({error})."
    if not problem and isinstance(body, dict) and (read := json.dumps(as_transformers_reads(body))) != json.dumps(body):
        request._body = read.encode()  # (starlette keeps `_body`; 100 == 100.0: compared as text)
    request.state.stops = () if problem else stop_strings(body, stops)
    if not problem and isinstance(body, dict) and request.url.path.rstrip("/").endswith("/responses"):
        request.state.limit = token_limit(body, limit)
    return problem


def template_refusal(error: BaseException) -> str | None:
    """The reason when `error` is a chat template's own refusal of a conversation (its `raise_exception`: a jinja2
    `TemplateError` itself; a subclass, such as a syntax error, is the checkpoint's fault): a 400, no server
    failure; else None."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        return None
    return f"the model's chat template refuses this request: {error}" if type(error) is TemplateError else None


def as_transformers_reads(body: dict) -> dict:
    """`body` with OpenAI's values in the form transformers' handlers take: `stream` false when unset, `logit_bias`'s
    whole numbers as the floats of its `sequence_bias`, an empty `stop` list (OpenAI's "no stop") left out, and refusals
    as text (the handlers would drop them without a word): refusal parts, and a replayed assistant message's `refusal`
    field."""
    body = dict(body)
    if body.get("stream") is None:  # OpenAI's default (transformers 5.24's /v1/responses streamed such a request)
        body["stream"] = False
    if body.get("logit_bias"):
        body["logit_bias"] = {key: float(value) for key, value in body["logit_bias"].items()}
    if body.get("stop") == []:
        del body["stop"]
    for field in ("messages", "input"):
        items = body.get(field)
        if isinstance(items, list) and items and isinstance(items[0], dict) and "role" not in items[0]:
            body[field] = [_as_text(part) for part in items]  # the Responses API's flat list of one message's parts
        elif isinstance(items, list):
            body[field] = [_refusal_as_text(item) for item in items]
    return body


def _refusal_as_text(item):
    """A message with its refusals as text (its refusal parts; its `refusal` field when its content is empty, as the
    `openai` client replays a refused answer); anything else as it is."""
    if not isinstance(item, dict) or "role" not in item:
        return item
    if not item.get("content") and isinstance(item.get("refusal"), str):
        return {**item, "content": item["refusal"]}
    if isinstance(item.get("content"), list):
        return {**item, "content": [_as_text(part) for part in item["content"]]}
    return item


def _as_text(part):
    """A refusal part as the text part that says the same; any other part as it is."""
    if isinstance(part, dict) and part.get("type") == "refusal":
        return {"type": "text", "text": part.get("refusal")}
    return part


def _text_part(part) -> bool:
    """Whether `part` is a content part the served (text-only) models read: `{"type": "text", "text": "..."}`, the
    Responses API's `input_text` / `output_text`, or an assistant's `{"type": "refusal", "refusal": "..."}` (read as
    its text); transformers' handlers drop a part of another type without a word (an image, audio) and fail on one
    without its text."""
    part = _as_text(part)
    return isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)


def _message(item) -> bool:
    """Whether `item` is a message the served models read: a role that is text, and content as text or a list of text
    parts, or none where an assistant's `refusal` stands for it (as the `openai` client replays a refused answer);
    any `refusal` as text. A message without its content, or with a role of another type, reached the chat template
    as it was (an answer to a conversation the client did not send)."""
    if not isinstance(item, dict) or not isinstance(item.get("role"), str):
        return False
    refusal, content = item.get("refusal"), item.get("content")
    if not isinstance(refusal, (str, type(None))):
        return False
    if content is None:
        return item["role"] == "assistant" and isinstance(refusal, str)
    return isinstance(content, str) or isinstance(content, list) and all(map(_text_part, content))


def value_problem(body: dict) -> str | None:
    """Why a field of `body` has a value the server cannot take (text that is not Unicode, a `stop` that is not text,
    `messages` that are not a list of messages (`_message`), an `instructions` that is not text, a `generation_config`
    that is not a JSON object's text, a `prompt` that is not one string: `prompt_problem`, a setting out of its range:
    `setting_problem`), or None."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        bad = error.object[error.start:error.end]
        return f"the request holds text that is not valid Unicode ({error.reason}: {bad!r})."
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) and stop or isinstance(stop, list)
                                 and all(isinstance(s, str) and s for s in stop)):
        return f"stop={stop!r} must be a non-empty string or a list of them (an empty list: no stop)."
    messages = body.get("messages")
    if messages is not None and not (isinstance(messages, list) and all(map(_message, messages))):
        return (f"messages={messages!r} must be a list of messages, each with its role and its content as text or "
                'text parts ({"role": ..., "content": "..." or [{"type": "text", "text": "..."}]}) and any refusal as '
                "text: the model reads text only.")
    given = body.get("input")
    parts = isinstance(given, list) and given and isinstance(given[0], dict) and "role" not in given[0]
    if given is not None and not (isinstance(given, str) or isinstance(given, list) and all(
            isinstance(item, dict) and ("role" not in item and _text_part(item) if parts else
                                        _message(item) if "role" in item else "type" in item)
            for item in given)):
        return (f"input={given!r}: give a string, or a list that starts with a message (with a role; content as "
                "text or text parts) followed by messages and typed items; a list that starts with no message is "
                'read as one user message\'s text parts ({"type": "input_text", "text": "..."}): the model reads '
                "text only.")
    instructions = body.get("instructions")  # (the Responses API's system message: the handler failed on a non-string)
    if instructions is not None and not isinstance(instructions, str):
        return f"instructions={reprlib.repr(instructions)} must be a string (the system message), or left out."
    config = body.get("generation_config")
    if config is not None:
        try:
            settings = json.loads(config) if isinstance(config, str) else None
        except ValueError:
            settings = None
        if not isinstance(settings, dict):
            return (f"generation_config={config!r} must be a JSON object written as a string, e.g. "
                    '"{\\"speculative_mode\\": \\"pipeline\\"}".')
    bias = body.get("logit_bias")
    if bias is not None and not (isinstance(bias, dict) and all(
            key.isdigit() and not isinstance(value, bool) and isinstance(value, (int, float)) and -100 <= value <= 100
            for key, value in bias.items())):
        return f"logit_bias={bias!r} must map token ids (as strings) to numbers in [-100, 100]."
    return prompt_problem(body.get("prompt")) or setting_problem(body)


def prompt_problem(prompt) -> str | None:
    """Why `prompt` (of /v1/completions) is not what transformers' handler reads, one string, or None (unset). OpenAI
    also takes a list of strings, of token ids or of such lists (several prompts, or tokens): the handler answered
    those with a bare "prompt must be a string."."""
    if prompt is None or isinstance(prompt, str):
        return None
    kind = f"a value of type {type(prompt).__name__}"
    if isinstance(prompt, list) and prompt:
        kinds = {"a list of strings": str, "a list of token ids": int, "a list of token-id lists": list}
        kind = next((name for name, item in kinds.items() if all(type(p) is item for p in prompt)), kind)
    return (f"prompt={reprlib.repr(prompt)} is {kind}: this server takes one prompt per request, as a string; send "
            "one request per prompt, with token ids decoded to their text.")


POOL_ADVICE = "shorten the request, or start a manager with a larger ContinuousBatchingConfig(num_blocks=...)"


NO_TOKENS = ("input_ids has no tokens ", "input_ids=[]: ")  # `generate`'s and a manager's refusal of an empty row
PLAIN_ADVICE = ("speculative_mode=None", "or None for plain decoding")  # advice no request can follow


def served_advice(refusal: str) -> str:
    """A refusal of `generate` or of a continuous-batching manager as a request to this server can follow: an empty
    row of tokens is named as the empty prompt it came from (a completion's `prompt` of "" with a tokenizer that adds
    no BOS token; the client sent no input_ids); one advising speculative_mode=None, which no request can send (a null
    is not passed on: `request_problem`), says what a request and the server can do; a manager's pool too small for a
    request names the server's options, not the library's calls."""
    if refusal.startswith(NO_TOKENS):
        return ("prompt is empty once tokenized (this model's tokenizer adds no BOS token), and the first generated "
                "token needs a context: send a prompt of at least one token.")
    if POOL_ADVICE in refusal:  # (`generation.continuous.settings.request_problem`)
        return (f"{refusal[:refusal.index(POOL_ADVICE)]}send a shorter prompt or a smaller max_tokens (without it, "
                "max_new_tokens is the server's default), or restart the server with a larger --cb-num-blocks "
                "(--cb-max-memory-percent when memory caps the pool).")
    if not any(advice in refusal for advice in PLAIN_ADVICE):
        return refusal
    return (f"{refusal.rstrip()} A request to this server cannot set speculative_mode=None: leave speculative_mode "
            "out of it, and for what needs plain decoding serve a checkpoint whose generation_config.json sets no "
            "speculative_mode.")


def setting_problem(body: dict) -> str | None:
    """Why a setting of `body` is out of what the server takes, or None: a `seed` torch does not take, a `stream` or
    `stream_options.include_usage` that is not a bool (transformers would take any truthy value), a `stream_options`
    that is not an object, a `temperature` or `top_p` out of its range, or a `frequency_penalty` that is not a number
    the server can apply (it passes `repetition_penalty = 1 + frequency_penalty`, which must be positive: above -1,
    and at most OpenAI's 2). A bool is no number; NaN and the infinities are in no range."""
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEEDS[0] <= seed <= SEEDS[1]):
        fraction = isinstance(seed, float) and math.isfinite(seed) and not seed.is_integer()
        cut = f" (transformers would cut it to {int(seed)})" if fraction else ""
        return f"seed={seed!r} must be a whole number in [{SEEDS[0]}, {SEEDS[1]}]{cut}."
    if body.get("stream") is not None and not isinstance(body["stream"], bool):  # (transformers: any truthy value)
        return f"stream={body['stream']!r} must be true or false."
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return f'stream_options={options!r} must be an object, e.g. {{"include_usage": true}}, or left out.'
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        return f"stream_options.include_usage={usage!r} must be true or false (true: a last event with the usage)."
    for name, high in (("temperature", 2.0), ("top_p", 1.0)):
        value = body.get(name)
        if value is not None and not (_number(value) and 0 <= value <= high):
            return f"{name}={value!r} must be a number in [0, {high:g}]."
    penalty = body.get("frequency_penalty")
    if penalty is not None and not (_number(penalty) and -1 < penalty <= 2):
        return (f"frequency_penalty={penalty!r} must be a number above -1 and at most 2: this server applies it as "
                "transformers' repetition_penalty = 1 + frequency_penalty, which must be positive (OpenAI's [-2, -1] "
                "cannot be honoured); pass a number in (-1, 2], or leave it out (0: no penalty).")
    return None


def _number(value) -> bool:
    """Whether `value` is a JSON number (an int or a float; not a bool, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
