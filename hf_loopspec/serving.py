"""`hf-loopspec serve [MODEL] [OPTIONS]`: transformers' own OpenAI-compatible server (`transformers serve`) with the
package's looped models registered.

Every option is `transformers serve`'s own (`--port`, `--host`, `--continuous-batching`, `--device`, `--dtype`,
`--cb-*`, ...; `hf-loopspec serve --help` lists them), parsed by transformers' own command; this module adds:

* MODEL defaults to the embedded default model (also when given as `default`); a checkpoint folder is checked as
  `hf-loopspec generate` checks it, a model that is not one of the package's looped families is refused, and so is
  a setting of its generation config that its model refuses (`prompting.check_checkpoint`);
* `--threads N`: torch's CPU threads (default 1, as `generate`), and `--debug`;
* the model class is made resolvable where transformers' model manager looks it up: it loads a checkpoint with
  `getattr(transformers, config.architectures[0])`, and the package's classes are not attributes of the
  `transformers` module. `expose_architecture` sets that one public name (the class `AutoModelForCausalLM` maps
  the checkpoint's config to, as `serving_stops.served_class`: stop strings judged on the generated text) on the
  module, so the manager loads the package's class; nothing private is replaced.

Requests decode as `model.generate` does with the checkpoint's generation config, so a checkpoint whose
`generation_config.json` names a `speculative_mode` is served speculatively (the embedded model: auto). What a
request can set is what transformers' handlers forward: `max_tokens` (chat: also `max_completion_tokens`; unset: the
checkpoint's `max_new_tokens`, raised to 1024), `temperature` (0: greedy; otherwise `do_sample` stays the
checkpoint's), `top_p`, `seed` (torch's global seed), `frequency_penalty` (repetition_penalty = 1 + it), `stop` (stop
strings), chat's `logit_bias` (its whole numbers passed on as floats; refused on /v1/completions, whose handler drops
it), and `generation_config`: a JSON string of generation settings (`speculative_mode` "pipeline" or "block",
`draft_loops`, `num_speculative_tokens`, `do_sample`, `top_k`, ...); `generate` fills the keys it leaves unset from
the checkpoint's config, so a request cannot turn a checkpoint's speculative default off (a null is refused). With
`--continuous-batching`, transformers builds one manager from the first request's settings (5.25: from the
checkpoint's generation config, as the model loads) and forwards only `max_tokens` and the EOS of later ones; a later
request whose other settings differ, and a request the manager cannot serve, get HTTP 400 with the reason
(`serving_batching`; 5.25: `serving_engine`). Requests name the model as the server was given it (`GET /v1/models`
lists it: the embedded model's folder by default) or leave it out. A request that sets `n`, `best_of`, `logprobs`,
`top_logprobs`, `echo` or `presence_penalty` to anything but its default, or a token limit that is not a whole number
>= 1, gets HTTP 400 with the reason (`serving_requests.request_problem`; transformers would ignore them, or round 1.5
down, with a line in the server's log only). HTTP errors, a body that is not JSON or nests too deeply included, and a
stream's error event come in OpenAI's error shape (`openai_errors`), so an `openai` client's exception says why (a
chat, completions or Responses stream failing before its first token gets the status a request without streaming
gets: `serving_streams`);
`suffix`, `tools`, a `response_format` and the Responses API's `text.format`, `previous_response_id` and `include`,
which transformers' handlers would drop, get HTTP 400 too, and so do values they would fail on with a bare 500
(`serving_requests.value_problem`: a lone surrogate, a numeric `stop`, `messages` as a string or without roles, content
that is missing or not text or a list of text parts, a Responses `instructions` that is not a string, a chat request
without `messages` or a Responses one without `input`, a `generation_config` that is not a JSON object's text, a
`prompt` that is not one string, a `stream_options` that is not an object of bools) and a `temperature`, `top_p` or
`frequency_penalty` out of range; so does a content part that is not text (an image, audio), which they would drop
without a word: the served models read text only. An empty `stop` list means no stop, as in OpenAI's API; a chat or
completions answer ends before the first stop string in it, streaming or not (`serving_stops`), and refusals (refusal
parts, and a replayed assistant message's `refusal` field when its content is empty) reach the model as text. Any other
error of a handler is a 500 in OpenAI's error shape, naming it. Chat and completions streams end with OpenAI's `data:
[DONE]` event. A client that leaves before its answer ends its request quietly (no error in the server's log). A
Responses answer that reached its token limit is "incomplete" (`serving_responses`), as OpenAI's API answers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .defaults import CPUS
from .serving_requests import body_problem, served_advice, template_refusal
from .serving_responses import HANDLERS_LEAST, default_limit, with_status
from .serving_stops import check_checkpoint_stops, served_class, without_stops
from .serving_streams import failure, openai_error_events, stream_status, tag_stream_errors

DEFAULT_THREADS = 1  # as `hf-loopspec generate --threads`
DONE_STREAMS = frozenset({"/v1/chat/completions", "/v1/completions"})  # OpenAI ends their streams with [DONE]
SERVER_LOG = logging.getLogger("uvicorn.error")  # where uvicorn logs a failed request
# what the model's process (transformers 5.25) raises for a checkpoint it cannot load: the user's to fix
LOAD_REFUSALS = frozenset({"ValueError", "OSError", "FileNotFoundError", "IsADirectoryError", "PermissionError"})
OWN_HELP = ("\n\nhf-loopspec serve: FORCE_MODEL (MODEL) defaults to the embedded default model; --threads N sets "
            f"torch's CPU threads (default {DEFAULT_THREADS}); --debug shows tracebacks.")


def parse(argv: list[str]) -> tuple[dict, argparse.Namespace]:
    """`(keyword arguments of transformers' Serve, own options)` for the arguments after `serve`; MODEL resolved to a
    folder or Hub id. `ValueError` (one line) for an argument transformers' command refuses; `SystemExit(0)` after
    printing the help."""
    import typer
    from transformers.cli.serve import Serve
    from typer.exceptions import TyperException

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--threads", default=str(DEFAULT_THREADS))  # (read here: argparse's error is two lines)
    own.add_argument("--debug", action="store_true")
    options, rest = own.parse_known_args(argv)
    given, options.threads = options.threads, int(options.threads) if options.threads.isdecimal() else 0
    if not 1 <= options.threads <= CPUS:
        raise ValueError(f"--threads {given}: pass a number of CPU threads in [1, {CPUS}] (this machine's CPUs).")
    app = typer.Typer(add_completion=False)
    app.command(name="serve", help=(Serve.__doc__ or "") + OWN_HELP)(Serve)
    command = typer.main.get_command(app)
    try:
        context = command.make_context("hf-loopspec serve", list(rest))
    except typer.Exit as done:  # --help was printed
        raise SystemExit(done.exit_code) from None
    except TyperException as err:  # a usage error of transformers' command: unknown option, bad value
        raise ValueError(f"{err.format_message()} (see hf-loopspec serve --help)") from None
    params = dict(context.params)
    if params.get("api_server_count", 1) > 1:  # transformers >= 5.25: API servers in processes spawned afresh
        raise ValueError(f"--api-server-count {params['api_server_count']}: hf-loopspec serve runs one API server "
                         "(its request checks and error answers live in this process); leave the option out.")
    if not 1 <= params["port"] <= 65535:  # uvicorn would listen on another port, or fail after loading
        raise ValueError(f"--port {params['port']}: pass a TCP port in [1, 65535].")
    check_batching_flags(params)
    if params.get("device") not in (None, "auto"):
        from .loading import resolve_device

        resolve_device(params["device"])  # `ValueError` for meta, a missing CUDA, ...: refused before serving
    params["force_model"] = resolve_model(params["force_model"])
    return params, options


def check_batching_flags(params: dict) -> None:
    """`ValueError` (one line, naming the flag) for a `--cb-*` count below 1 or a `--cb-max-memory-percent` outside
    (0, 1]: the model's manager refused them only once the model had loaded, behind a traceback, naming fields of
    transformers' `ContinuousBatchingConfig`."""
    for name in ("cb_block_size", "cb_num_blocks", "cb_max_batch_tokens"):
        if params.get(name) is not None and params[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} {params[name]}: pass a whole number >= 1.")
    fraction = params.get("cb_max_memory_percent")
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--cb-max-memory-percent {fraction}: pass a fraction in (0, 1] of the free memory (0.9: "
                         "90%).")


def check_address(host: str, port: int) -> None:
    """`ValueError` (one line) when the server could not listen on `host`:`port` (in use, no such host), found by
    binding a socket there as uvicorn will, before the model loads (uvicorn would fail after it, in its log)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            reason = error.strerror or error
            raise ValueError(f"--host {host} --port {port}: the server cannot listen there ({reason}); pass a free "
                             "--port (or another --host).") from None


def resolve_model(spec: str | None) -> str:
    """The folder or Hub id to serve for MODEL (None or 'default': the embedded model); `ValueError` /
    `FileNotFoundError` (one line) for a path that cannot load or a benchmark shape (no weights, no tokenizer)."""
    from .bench.shapes import SHAPES
    from .input_checks import check_source
    from .loading import default_model_path

    if spec is None or spec == "default":
        return str(default_model_path())
    if spec in SHAPES:
        raise ValueError(f"MODEL {spec} is a random-weight benchmark shape with no tokenizer; pass a checkpoint "
                         "folder or Hub id, or omit MODEL for the embedded default model.")
    check_source(spec)
    return spec


def expose_architecture(spec: str, trust_remote_code: bool = False) -> type:
    """Make `getattr(transformers, config.architectures[0])` return the package's class for the checkpoint `spec`, as
    served (`serving_stops.served_class`: stop strings judged on the generated text), for the lookup of transformers'
    serving model manager, and return that class. `ValueError` when `spec`'s config is not one of the package's looped
    families."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from . import register
    from .input_checks import hub_errors_explained
    from .models.huginn import HuginnConfig
    from .models.ouro import OuroConfig

    register()
    with hub_errors_explained(spec):
        config = AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code)
    if not isinstance(config, (OuroConfig, HuginnConfig)):
        raise ValueError(f"MODEL {spec} is a {config.model_type} model, not a looped model of hf_loopspec (ouro, "
                         "huginn_raven); serve it with `transformers serve`.")
    model_class = served_class(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    for name in config.architectures or [model_class.__name__]:
        setattr(transformers, name, model_class)
    return model_class


def chat_template_note(spec: str) -> str | None:
    """A note for the operator when `spec`'s tokenizer has no chat template (/v1/chat/completions, /v1/responses and
    /v1/systemone then fail for every request), else None; `ModelNotAvailable` when it has no tokenizer
    (`loading.load_tokenizer`)."""
    from .loading import load_tokenizer

    tokenizer = load_tokenizer(spec)
    if getattr(tokenizer, "chat_template", None):
        return None
    return (f"hf-loopspec serve: note: the tokenizer of {spec} has no chat template, so /v1/chat/completions, "
            "/v1/responses and (without a --decision-config template) /v1/systemone cannot format messages and fail; "
            "/v1/completions serves raw prompts.")


def openai_errors(positions: int | None = None, limit: int = HANDLERS_LEAST, stops=None) -> None:
    """Make the server answer its HTTP errors in OpenAI's error shape, `{"error": {"message", "type", "code"}}` (the
    `openai` client puts `message` into its exception's text; with FastAPI's own `{"detail": ...}` it shows only the
    status), with FastAPI's `detail` kept beside it, a `ValueError` a request raises (settings `generate` refuses) as a
    400 in that shape instead of a bare 500, and a POST whose JSON body `request_problem` refuses (for a model of
    `positions` positions) as a 400 before transformers reads it; a handler's failure as a 500 (answered, not raised on:
    uvicorn would close the connection), transformers' dead engine as a 503, and a chat, completions or Responses stream
    that fails before its first token with one of those (`stream_status`); a Responses answer that reached its token
    limit (`limit` when the request sets none) as "incomplete" (`serving_responses`); `stops`: the checkpoint's stop
    strings, which a request without its own is decoded with. Wraps `build_server`, which transformers' `Serve`
    imports when it is constructed; idempotent, a later call setting the next server's positions, limit and stops."""
    from transformers.cli.serving import server
    from transformers.cli.serving import utils as serving_utils

    if hasattr(server.build_server, "wrapped"):
        server.build_server.settings = (positions, limit, stops)
        return
    original = server.build_server

    def build_server(*args, **kwargs):
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response
        from starlette.exceptions import HTTPException

        async def answer(request, error: HTTPException) -> JSONResponse:
            message = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
            kind = "invalid_request_error" if error.status_code < 500 else "server_error"
            body = {"error": {"message": message, "type": kind, "code": error.status_code}, "detail": error.detail}
            return JSONResponse(body, status_code=error.status_code, headers=error.headers)

        async def refuse(request, error: ValueError) -> JSONResponse:  # a request's settings `generate` refused
            return await answer(request, HTTPException(status_code=400, detail=served_advice(str(error))))

        async def failed(request, error: Exception) -> JSONResponse:  # any other error of a handler (logged too)
            reason = template_refusal(error)  # (the conversation's fault: a 400, which clients do not retry)
            return await answer(request, HTTPException(status_code=400 if reason else 500, detail=reason or failure(
                f"{type(error).__name__}: {error}")))

        async def malformed(request, error) -> JSONResponse:  # FastAPI's 422 for a body it cannot read
            reasons = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in error.errors())
            return await answer(request, HTTPException(status_code=422, detail=f"the request body: {reasons}."))

        async def check(request, call_next):
            problem = await body_problem(request, *build_server.settings)
            if problem:
                return await answer(request, HTTPException(status_code=400, detail=problem))
            try:
                response = await call_next(request)
            except Exception as error:  # a handler's failure, answered here: raised on, it closed the connection
                if isinstance(error, RuntimeError) and await request.is_disconnected():  # "No response returned."
                    return Response(status_code=499)  # (nginx's "client closed request": nobody reads it)
                if not template_refusal(error):  # (a refusal is the request's: no server failure to log)
                    SERVER_LOG.error("the server failed on %s", request.url.path, exc_info=error)
                return await failed(request, error)
            response = await as_openai_answers(request, response)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                path, chunks = request.url.path.rstrip("/"), response.body_iterator
                if path in (*DONE_STREAMS, "/v1/responses"):  # failed before its first token: the status it gets
                    status, detail, chunks = await stream_status(chunks)  # without streaming
                    if status is not None:
                        return await answer(request, HTTPException(status_code=status, detail=detail))
                response.body_iterator = openai_error_events(chunks, path in DONE_STREAMS)
            return response

        async def dead(request, error: Exception) -> JSONResponse:  # transformers' 503, in OpenAI's shape
            return await answer(request, HTTPException(status_code=503, detail=str(error)))

        tag_stream_errors()
        app = original(*args, **kwargs)
        if hasattr(serving_utils, "EngineDeadError"):  # transformers >= 5.25
            app.add_exception_handler(serving_utils.EngineDeadError, dead)
        app.add_exception_handler(HTTPException, answer)
        app.add_exception_handler(RequestValidationError, malformed)
        app.add_exception_handler(ValueError, refuse)
        app.add_exception_handler(Exception, failed)
        app.middleware("http")(check)
        return app

    build_server.wrapped, build_server.settings = original, (positions, limit, stops)
    server.build_server = build_server


async def as_openai_answers(request, response):
    """A handler's `response` as OpenAI's API answers: a chat or completions text that ends before the request's stop
    strings (`serving_stops`), a Responses answer "incomplete" at its token limit (`serving_responses`)."""
    if getattr(request.state, "stops", ()) and request.url.path.rstrip("/") in DONE_STREAMS:
        response = await without_stops(response, request.state.stops)
    if getattr(request.state, "limit", None) is not None:
        response = await with_status(response, request.state.limit)
    return response


def start(argv: list[str]):
    """Parse `argv`, prepare the model and construct transformers' `Serve`, which serves until stopped (with
    transformers 5.24's `--non-blocking`, it returns at once, the server running in a thread; stop it with
    `kill_server()`; 5.25 runs the model in a process of its own, `serving_engine`). Returns the `Serve`."""
    import torch
    from transformers import AutoConfig
    from transformers.utils.import_utils import is_serve_available

    from .generation.saved_config import checkpoint_generation_config
    from .input_checks import max_positions
    from .prompting import check_checkpoint

    params, options = parse(argv)
    check_address(params["host"], params["port"])
    if not is_serve_available():
        from .hub.install import install_command

        raise ValueError("serving needs fastapi, uvicorn and openai, which are not installed; install them with "
                         f"{install_command('serve')}.")
    from transformers.cli.serve import Serve

    torch.set_num_threads(options.threads)
    expose_architecture(params["force_model"], params["trust_remote_code"])
    config = AutoConfig.from_pretrained(params["force_model"], trust_remote_code=params["trust_remote_code"])
    check_checkpoint(params["force_model"], trust_remote_code=params["trust_remote_code"])
    generation = checkpoint_generation_config(params["force_model"])
    check_checkpoint_stops(getattr(generation, "stop_strings", None), params["force_model"],
                           bool(params.get("continuous_batching")))  # (before the model loads)
    openai_errors(max_positions(config), default_limit(generation), getattr(generation, "stop_strings", None))
    from transformers.cli.serving import model_manager

    if hasattr(model_manager, "ModelLoader"):  # transformers >= 5.25: each model runs in a process of its own
        from .serving_engine import install

        install()
    elif params.get("continuous_batching"):
        from .serving_batching import install

        install()
    note = chat_template_note(params["force_model"])
    if note:
        print(note, file=sys.stderr, flush=True)
    try:
        return Serve(**params)
    except RuntimeError as error:
        raise load_failure(error) from error


def load_failure(error: RuntimeError) -> Exception:
    """What `hf-loopspec serve` raises for `error` from `Serve`: transformers 5.25 loads the model in a process of its
    own and re-raises its failure here as a `RuntimeError("TYPE: message")`; a checkpoint the loader refuses (a
    `ValueError` or `OSError` there: weights that do not match the config, a missing file) becomes a `ValueError`
    (the CLI's one-line error, exit 2), anything else stays as it is."""
    kind, _, message = str(error).partition(": ")
    if kind in LOAD_REFUSALS:
        return ValueError(f"the model did not load: {message}")
    return error


def main(argv: list[str]) -> int:
    """`hf-loopspec serve ...` (the CLI's error handling around it): serve until interrupted; 0."""
    try:
        start(argv)
    except SystemExit as done:
        return int(done.code or 0)
    return 0
