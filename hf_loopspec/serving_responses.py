"""The Responses API's status of an answer its token limit cut short, as OpenAI's API gives it: transformers' handler
calls every answer "completed"; one whose output reached the request's limit is "incomplete", with
`incomplete_details.reason` "max_output_tokens" (its message item "incomplete" too), and its stream ends with a
`response.incomplete` event. `serving.openai_errors` applies `with_status` to every /v1/responses answer. It sees
the answer's token count, not why decoding ended: an answer whose EOS falls on its last allowed token is called
incomplete too (transformers' chat handler likewise reports `finish_reason` "length" there).

The limit is the request's `max_output_tokens`, else its `generation_config`'s `max_new_tokens`, else the server's
(`default_limit`: the checkpoint's `max_new_tokens`, raised to 1024, as transformers' handlers set it).
"""

from __future__ import annotations

import json

from .serving_events import rewritten

HANDLERS_LEAST = 1024  # transformers' handlers raise a checkpoint's max_new_tokens (or none) below this to it


def default_limit(generation_config) -> int:
    """The most tokens transformers' handlers let a request without a limit of its own generate."""
    value = getattr(generation_config, "max_new_tokens", None)
    return value if isinstance(value, int) and value >= HANDLERS_LEAST else HANDLERS_LEAST


def token_limit(body: dict, default: int) -> int:
    """The most tokens the Responses request `body` (checked by `serving_requests.request_problem`) may generate."""
    if body.get("max_output_tokens") is not None:
        return body["max_output_tokens"]
    settings = json.loads(body["generation_config"]) if isinstance(body.get("generation_config"), str) else {}
    value = settings.get("max_new_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def with_limit_status(response: dict, limit: int) -> dict:
    """A Responses object (its JSON, changed in place), "incomplete" when its output reached `limit` tokens."""
    tokens = (response.get("usage") or {}).get("output_tokens")
    if response.get("status") == "completed" and isinstance(tokens, int) and tokens >= limit:
        response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        for item in response.get("output") or []:
            if isinstance(item, dict) and item.get("type") == "message" and item.get("status") == "completed":
                item["status"] = "incomplete"
    return response


def with_event_status(event: dict, limit: int) -> dict:
    """A Responses stream event (its JSON, changed in place): its `response.completed` event, with the response
    `with_limit_status`, as `response.incomplete` when that made it incomplete; any other event as it is."""
    if event.get("type") == "response.completed" and isinstance(event.get("response"), dict):
        if with_limit_status(event["response"], limit)["status"] == "incomplete":
            event["type"] = "response.incomplete"
    return event


async def with_status(response, limit: int):
    """`response` (the /v1/responses handler's, streaming or not) with the status its output's length gives it."""
    return await rewritten(response, lambda event: with_event_status(event, limit),
                           lambda answer: with_limit_status(answer, limit))
