"""A stream's errors as OpenAI's API gives them. transformers' handlers start a stream before the request runs, so a
request refused or failing as it starts was answered 200 with an error event in the stream; here a stream that
failed before its first token gets the status the request gets without streaming (`stream_status`: 400 for a
refusal, 503 when the model's engine died, else 500), for chat and completions streams and for the Responses API's
(whose opening `response.created` and `response.in_progress` events carry no token, and whose error event
transformers codes "server_error" for a refusal too); an error event of a stream that had begun comes in OpenAI's
shape (`openai_error_events`). The stream errors transformers makes record which of them are failures rather than
refusals (`tag_stream_errors`, `STREAM_FAILURES`).
"""

from __future__ import annotations

import collections
import json
import sys

from .serving_requests import served_advice, template_refusal

STREAM_FAILURES = collections.deque(maxlen=256)  # (message, status) of stream errors no refusal (`tag_stream_errors`)
OPENING_EVENTS = frozenset({"response.created", "response.in_progress"})  # a Responses stream's, before any output


async def stream_status(chunks) -> tuple[int | None, str | None, object]:
    """`(status, reason, chunks to send)` for a chat, completions or Responses stream: a stream that failed before its
    first token gets the status the request gets without streaming (400 for a refusal; for a failure `STREAM_FAILURES`
    holds, 503 when the model's engine died, else 500) and no chunks; any other stream `(None, None, its chunks)`."""
    message, read = await error_before_tokens(chunks)
    if message is None:
        return None, None, replayed(read, chunks)
    await chunks.aclose()  # (its handler's clean-up)
    status = recorded_status(message)
    return status, failure(message) if status == 500 else served_advice(message), None


def recorded_status(message: str) -> int:
    """The status of a stream error of text `message`: the one `STREAM_FAILURES` holds for it (taken from there), else
    400 (a refusal)."""
    entry = next((entry for entry in STREAM_FAILURES if entry[0] == message), None)
    if entry is None:
        return 400
    STREAM_FAILURES.remove(entry)
    return entry[1]


def failure(text: str) -> str:
    """The reason of a 500: the server failed on a request (`text`: the error's type and message)."""
    return (f"the server failed on this request ({text}); a field of the request may lack what the server reads (see "
            "the server's log).")


def tag_stream_errors() -> None:
    """Make the stream errors transformers' serving modules create (`_StreamError`, which carries a message only: the
    error's text, to which a failure's type is added) record the message and status of failures that are no refusal (any
    exception but a `ValueError`) in `STREAM_FAILURES`, so that a stream failing before its first token gets the status
    a request without streaming gets: 400 for a refusal, 503 when the model's engine died (`EngineDeadError`), else 500.
    Idempotent. One subclass replaces the class in every module that holds it, so that the handlers' `isinstance` checks
    hold whichever of the two their module imported (a handler module imported after a subclass of one module's name,
    and errors made from another's, read a stream's error as text to send: a TypeError, and an empty stream)."""
    from transformers.cli.serving import model_manager, utils

    dead = getattr(utils, "EngineDeadError", ())
    base = utils._StreamError
    if getattr(base, "records_failures", False):
        return

    class StreamError(base):
        records_failures = True

        def __init__(self, msg: str):
            error = sys.exc_info()[1]  # (created in the `except` block of the failed request, from its text alone)
            failed = error is not None and not isinstance(error, ValueError) and not template_refusal(error)
            if failed and not msg.startswith(f"{type(error).__name__}:"):  # a failure's message names its type
                msg = f"{type(error).__name__}: {msg}"
            super().__init__(msg)
            if failed:
                STREAM_FAILURES.append((msg, 503 if isinstance(error, dead) else 500))

    for module in (model_manager, utils):  # where 5.25 (model_manager) and 5.24 (utils) create them
        if getattr(module, "_StreamError", None) is base:
            module._StreamError = StreamError


async def error_before_tokens(chunks) -> tuple[str | None, list]:
    """`(message, chunks read)`: the message of the error event a stream sent before any token (a request that failed,
    or whose settings `generate` refused, as it started: chat and completions send `{"error": "text"}`, the Responses
    API `{"type": "error", "message": "text"}`), or None once an event of another kind came (a chat stream's first
    event, which names the assistant's role only, and a Responses stream's `OPENING_EVENTS` are skipped); the chunks
    read, to be sent on. A chunk may hold several events, or part of one (read as no error)."""
    read = []
    async for chunk in chunks:
        read.append(chunk)
        raw = chunk if isinstance(chunk, bytes) else chunk.encode("utf-8")
        for part in filter(None, (part.strip() for part in raw.split(b"\n\n"))):
            try:
                event = json.loads(part[len(b"data: "):]) if part.startswith(b"data: {") else None
            except ValueError:  # not one whole event
                event = None
            if not isinstance(event, dict):
                return None, read
            if isinstance(event.get("error"), str):
                return event["error"], read
            if event.get("type") == "error" and isinstance(event.get("message"), str):
                return event["message"], read
            choice = (event.get("choices") or [{}])[0]
            delta = choice.get("delta") if isinstance(choice, dict) else None
            role_only = isinstance(delta, dict) and not choice.get("finish_reason") and not any(
                value for key, value in delta.items() if key != "role")
            if not role_only and event.get("type") not in OPENING_EVENTS:
                return None, read
    return None, read


async def replayed(read: list, chunks):
    """The chunks `read`, then the rest of `chunks`."""
    for chunk in read:
        yield chunk
    async for chunk in chunks:
        yield chunk


async def openai_error_events(chunks, done: bool = False):
    """A stream's server-sent events, an error event `data: {"error": "text"}` (transformers' handlers send one when a
    request fails after its stream began) rewritten in OpenAI's shape, `{"error": {"message": "text", ...}}`, whose
    message the `openai` client puts in its exception, with the type and code of its status (`recorded_status`); with
    `done`, the stream ends with OpenAI's `data: [DONE]` event (the chat and legacy completions streams do; clients that
    wait for it would otherwise wait for the connection to close)."""
    async for chunk in chunks:
        raw = chunk if isinstance(chunk, bytes) else chunk.encode("utf-8")  # (bytes: never split a character)
        if raw.startswith(b'data: {"error": "'):
            try:
                payload = json.loads(raw[len(b"data: "):])
            except ValueError:  # not one whole event: passed on as it came
                payload = {}
            if isinstance(payload.get("error"), str):
                status = recorded_status(payload["error"])
                kind = "invalid_request_error" if status < 500 else "server_error"
                error = {"message": payload["error"], "type": kind, "code": status}
                chunk = f"data: {json.dumps({'error': error})}\n\n".encode()
        yield chunk
    if done:
        yield b"data: [DONE]\n\n"
