"""A request's stop strings kept out of its answer, as OpenAI's API returns it ("the returned text will not contain
the stop sequence"): transformers' handlers stop generating once a stop string appears (`stop_strings`) but return
the text with it, and whatever the last token carried after it; and their stop-string criterion reads the prompt
too, so a stop string that begins in the prompt ended the answer at the first token that completes it. A request's
stop strings are its `stop`, else its `generation_config`'s `stop_strings`, else the checkpoint's (`stop_strings`).

The server loads a checkpoint as `served_class` of its model class, whose `generate` judges stop strings on the text
generated alone (`OutputStops`), as OpenAI's API does. `serving.openai_errors` applies `without_stops` to every answer
of /v1/completions and /v1/chat/completions decoded with stop strings (`stop_strings`). The text (chat: the
message's `content`) ends where the first stop string to appear in it begins (`stop_at`: the one that ends first; of
those, the longest), with finish_reason "stop" then. A stream holds back the end of its text that could still begin a
stop string until the next text (or the stream's last event) resolves it (`StopCut`), so no event carries stop text,
and its texts, joined, are the answer the request gets without streaming.
"""

from __future__ import annotations

import contextvars
import copy
import json

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from .generation.inputs import stop_strings_given
from .serving_events import rewritten


def stop_strings(body, default=None) -> tuple[str, ...]:
    """The stop strings a request's JSON `body` is decoded with, as the served `generate` takes them (`output_stops`):
    its `stop` (as `serving_requests.value_problem` lets it through: a non-empty string, or a list of them), else the
    `stop_strings` of its `generation_config` (the text of a JSON object), else `default` (the checkpoint's); none
    when none of them names any."""
    if not isinstance(body, dict):
        return ()
    try:
        settings = json.loads(body["generation_config"]) if isinstance(body.get("generation_config"), str) else None
    except ValueError:  # (refused by `request_problem` before it comes here)
        settings = None
    requested = settings.get("stop_strings") if isinstance(settings, dict) else None
    stops = chosen_stops(body.get("stop"), requested, default)
    return ((stops,) if isinstance(stops, str) else tuple(stops)) if stop_strings_given(stops) else ()


def chosen_stops(*given):
    """The stop strings a served call decodes with, of those `given` in order of precedence (the request's `stop`,
    its generation config's `stop_strings`, the checkpoint's): the first that names any (an empty list names none),
    else None."""
    return next((stops for stops in given if stops), None)


def stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    """Where `text` is cut: the start of the first of `stops` (non-empty) to appear in it, i.e. the occurrence that
    ends first (of those ending at once, the one that starts first), or None when none appears."""
    found = [(start + len(stop), start) for stop in stops if (start := text.find(stop)) >= 0]
    return min(found)[1] if found else None


def undecided(text: str, stops: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could still begin one of `stops`: the length of the longest end of
    `text` that is a proper beginning of one (0: none)."""
    return max((size for stop in stops for size in range(1, min(len(stop), len(text) + 1))
                if text.endswith(stop[:size])), default=0)


class StopCut:
    """A stream's texts, in order, with `stops` kept out: `feed` gives the part of a text that can be sent now (none
    once a stop string appeared: `stopped`), `rest` the part held back, at the stream's end. The texts `feed` and
    `rest` give, joined, are the joined texts cut by `stop_at`."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self.held + text  # (a stop string not wholly in what came before starts in `held`, or later)
        end = stop_at(text, self.stops)
        if end is not None:
            self.held, self.stopped = "", True
            return text[:end]
        end = len(text) - undecided(text, self.stops)
        self.held = text[end:]
        return text[:end]

    def rest(self) -> str:
        text, self.held = self.held, ""
        return text


def text_field(choice: dict) -> tuple[dict, str]:
    """`(holder, key)`: where a choice of a chat or completions answer or stream event holds its text (a chat
    stream's `delta`, a chat answer's `message`: their `content`; a completion's choice: its `text`)."""
    for name in ("delta", "message"):
        if isinstance(choice.get(name), dict):
            return choice[name], "content"
    return choice, "text"


def cut_answer(answer: dict, stops: tuple[str, ...]) -> dict:
    """A chat or completions answer (its JSON, changed in place) with each choice's text cut before the first of
    `stops` in it (`stop_at`), its finish_reason "stop" then."""
    for choice in answer.get("choices") or []:
        holder, key = text_field(choice)
        end = stop_at(holder[key], stops) if isinstance(holder.get(key), str) else None
        if end is not None:
            holder[key], choice["finish_reason"] = holder[key][:end], "stop"
    return answer


def cut_event(event: dict, cut: StopCut) -> dict | None:
    """A chat or completions stream event (its JSON, changed in place) with its text as `cut` lets it through, and
    the text held back added to the event that ends the choice (its finish_reason, "stop" once a stop string
    appeared); None for an event that carried text and is left with nothing to send. Other events as they are."""
    choice = (event.get("choices") or [None])[0]
    if not isinstance(choice, dict):
        return event
    holder, key = text_field(choice)
    text, finished = holder.get(key), choice.get("finish_reason") is not None
    if not (isinstance(text, str) or finished):
        return event
    sent = cut.feed(text or "") + (cut.rest() if finished else "")
    if sent or text:
        holder[key] = sent
    if finished and cut.stopped:
        choice["finish_reason"] = "stop"
    others = key == "content" and any(value for name, value in holder.items() if name != key)  # (a delta's role)
    return None if text and not sent and not finished and not others else event


async def without_stops(response, stops: tuple[str, ...]):
    """`response` (a chat or completions handler's, streaming or not) with `stops` kept out of its text: a stream's
    events cut as they go by one `StopCut` (`cut_event`), a JSON answer of status 200 cut (`cut_answer`); any other
    response as it is."""
    cut = StopCut(stops)
    return await rewritten(response, lambda event: cut_event(event, cut) if "choices" in event else event,
                           lambda answer: cut_answer(answer, stops))


class OutputStops(StoppingCriteria):
    """Stops a row once one of `stops` appears in the text of its tokens past the first `start` columns (the text it
    generated, decoded as the handlers decode an answer: special tokens skipped)."""

    def __init__(self, stops: tuple[str, ...], tokenizer, start: int):
        self.stops, self.tokenizer, self.start = stops, tokenizer, start

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:  # input_ids: [B, T] -> [B] bool
        texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
        return torch.tensor([stop_at(text, self.stops) is not None for text in texts], device=input_ids.device)


def output_stops(kwargs: dict, inputs=None, default=None) -> dict:
    """A `generate` call's keyword arguments (its prompt: `inputs`, else `input_ids`) with its stop strings judged by
    an `OutputStops` criterion instead: `stop_strings`, else its generation config's (as transformers' handlers pass
    a request's `stop`), else `default` (the checkpoint's); as they are when it has none, no prompt or tokenizer, or
    stop strings that are not a non-empty string or a list of them (`generate` refuses those, naming them)."""
    config = kwargs.get("generation_config")
    stops = chosen_stops(kwargs.get("stop_strings"), getattr(config, "stop_strings", None), default)
    ids, tokenizer = kwargs.get("input_ids") if inputs is None else inputs, kwargs.get("tokenizer")
    if not (stop_strings_given(stops) and torch.is_tensor(ids) and ids.ndim == 2 and tokenizer is not None):
        return kwargs
    stops = (stops,) if isinstance(stops, str) else stops
    kwargs = {key: value for key, value in kwargs.items() if key != "stop_strings"}
    if getattr(config, "stop_strings", None):
        kwargs["generation_config"] = config = copy.deepcopy(config)
        config.stop_strings = None
    criterion = OutputStops(tuple(stops), tokenizer, ids.shape[1])
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or ()), criterion])
    return kwargs


def check_checkpoint_stops(stops, checkpoint: str, batching: bool) -> None:
    """`ValueError` before a server loads `checkpoint`, whose generation config names stop strings `stops` (None:
    none), when they are no stop strings `generate` takes (the server would decode without them, without a word: it
    judges a checkpoint's stop strings itself, `served_class`), or when it is served with continuous batching
    (`batching_refusal`)."""
    if stops is not None and not stop_strings_given(stops):
        raise ValueError(f"{checkpoint}: its generation_config.json names stop_strings={stops!r}, which must be a "
                         "non-empty string or a non-empty list of them: fix or remove them there.")
    if batching and stops:
        raise ValueError(batching_refusal(stops))


def batching_refusal(stops) -> str:
    """Why `--continuous-batching` cannot serve a checkpoint whose generation config names `stops`."""
    return (f"the checkpoint's generation config names stop_strings={stops!r}, but a continuous-batching manager stops "
            "a request at its EOS ids and max_new_tokens only: serve it without --continuous-batching, or remove "
            "stop_strings from its generation_config.json.")


SERVED: dict[type, type] = {}  # a model class -> its `served_class`
IN_SERVED_CALL = contextvars.ContextVar("in_served_call", default=False)  # inside a served class's `generate`


def served_class(model_class: type) -> type:
    """`model_class` as the server loads it: a subclass of the same name whose `generate` judges stop strings on the
    generated text alone (`output_stops`), everything else the class's own. Its `from_pretrained` takes the
    checkpoint's own stop strings out of the model's generation config (transformers would fill a call's cleared
    stop strings from there, and judge them on the prompt too) into `checkpoint_stops`, which a call without stop
    strings of its own is judged by; `init_continuous_batching` refuses a model that has them (a manager stops at
    EOS ids and max_new_tokens only)."""
    if model_class not in SERVED:
        class Served(model_class):
            checkpoint_stops = None

            @classmethod
            def from_pretrained(cls, *args, **kwargs):
                model = super().from_pretrained(*args, **kwargs)
                config = model.generation_config
                model.checkpoint_stops, config.stop_strings = config.stop_strings, None
                return model

            def generate(self, inputs=None, **kwargs):
                if IN_SERVED_CALL.get():  # an inner call (auto's stretches and probes): the outer call's stops hold
                    return super().generate(inputs, **kwargs)
                token = IN_SERVED_CALL.set(True)
                try:
                    return super().generate(inputs, **output_stops(kwargs, inputs, self.checkpoint_stops))
                finally:
                    IN_SERVED_CALL.reset(token)

            def init_continuous_batching(self, generation_config=None, *args, **kwargs):
                # a manager stops at EOS ids and max_new_tokens only: it would run past the checkpoint's stop strings
                # (moved out of the model's generation config) without a word, so `--continuous-batching` refuses
                # such a checkpoint (anything but a config or None: the manager's own refusal)
                given = generation_config is None or isinstance(generation_config, GenerationConfig)
                if self.checkpoint_stops and given and getattr(generation_config, "stop_strings", None) is None:
                    raise ValueError(batching_refusal(self.checkpoint_stops))
                return super().init_continuous_batching(generation_config, *args, **kwargs)

        Served.__name__ = Served.__qualname__ = model_class.__name__
        Served.__doc__ = served_class.__doc__
        SERVED[model_class] = Served
    return SERVED[model_class]
