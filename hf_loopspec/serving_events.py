"""A handler's answer rewritten on its way out: each JSON event of a stream (server-sent events, `data: {...}`), or a
JSON answer of status 200. `serving_stops` (stop strings kept out of the text) and `serving_responses` (the
Responses API's status) rewrite answers so."""

from __future__ import annotations

import json


async def rewritten(response, change_event, change_answer):
    """`response` with each JSON event of its stream as `change_event` returns it (None: the event is not sent), or
    its JSON answer of status 200 as `change_answer` returns it; any other response as it is."""
    from fastapi.responses import JSONResponse

    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        response.body_iterator = _changed_events(response.body_iterator, change_event)
        return response
    if response.status_code != 200 or not kind.startswith("application/json"):
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])
    headers = {name: value for name, value in response.headers.items() if name.lower() != "content-length"}
    return JSONResponse(change_answer(json.loads(body)), status_code=200, headers=headers)


async def _changed_events(chunks, change_event):
    """The chunks of a stream (events, whole or in pieces) as whole events, changed (`_changed`)."""
    pending = b""
    async for chunk in chunks:
        pending += chunk if isinstance(chunk, bytes) else chunk.encode("utf-8")
        *events, pending = pending.split(b"\n\n")
        sent = b"".join(_changed(event, change_event) for event in events)
        if sent:
            yield sent
    if pending:  # (a stream that ended mid-event: passed on as it came)
        yield pending


def _changed(event: bytes, change_event) -> bytes:
    """One event (without its blank line) with its JSON payload as `change_event` returns it, with its blank line;
    b"" for none; an event that holds no JSON object as it came."""
    try:
        payload = json.loads(event[len(b"data: "):]) if event.startswith(b"data: {") else None
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return event + b"\n\n"
    payload = change_event(payload)
    return b"" if payload is None else f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()
