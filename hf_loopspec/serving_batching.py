"""`hf-loopspec serve --continuous-batching` on transformers 5.24 (5.25: `serving_engine`, which shares
`settings_problem`): transformers' continuous-batching request manager of the server, with clear answers where
transformers' own would drop a request's settings or leave a client waiting.

transformers' server builds one manager (`model.init_continuous_batching`) from the first request's generation
config and forwards only `max_new_tokens` and the EOS ids of each later request (`add_request`). `LoopServingManager`
(installed by `install`, in place of `CBGenerateManager`, the class the server's `GenerationState` builds) keeps that,
and answers HTTP 400 with the reason:

* when the manager cannot start with the first request's settings (`init_continuous_batching`'s `ValueError`; the
  next request tries again with its own);
* when a later request's settings differ from the manager's in anything but `max_new_tokens` and EOS
  (`settings_problem`): a request's settings are the checkpoint's generation config overlaid with what the request
  sets, as `generate` merges them (sampling settings compare only when either side samples);
* when the manager refuses the request itself (a prompt too long for a slot, ...), non-streaming (streaming: the
  error is the stream's last event, as transformers sends it).
"""

from __future__ import annotations

from .serving_requests import served_advice

# what a request may change on a running manager, and bookkeeping keys with no effect on decoding
PER_REQUEST = frozenset({"max_new_tokens", "max_length", "eos_token_id", "use_cache", "transformers_version",
                         "_from_model_config"})
SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"})
OFF_AS_UNSET = frozenset({"use_weighted_exit"})  # options whose False asks for nothing, as unset does


def effective(model_config, config) -> dict:
    """The settings `generate` decodes with for `config`: the checkpoint's `model_config`, overlaid with the keys
    `config` sets to something other than `GenerationConfig`'s defaults."""
    return {**model_config.to_diff_dict(), **config.to_diff_dict()}


def settings_problem(model_config, manager_config, request_config,
                     started_by: str = "the first one, which started the manager", recurrence=None,
                     also: str = "") -> str | None:
    """Why a request with `request_config` cannot join a manager started with `manager_config` (the settings of
    `started_by`), or None. `recurrence`: the manager's recurrence settings (a Huginn-family model's
    `ManagerSettings.recurrence`), the values its unset `num_steps`, `init_scale` and `init_seed` mean. `also`: what
    else a request may change, for the message."""
    manager, request = effective(model_config, manager_config), effective(model_config, request_config)
    # what an unset key means: None, or the value generate gives it (unset do_sample: greedy, as do_sample=False)
    defaults = {**type(model_config)().to_dict(), **type(model_config)._get_default_generation_params()}
    if recurrence is not None:
        defaults.update(num_steps=recurrence.num_steps, init_scale=recurrence.init_scale,
                        init_seed=recurrence.init_seed)
    sampled = manager.get("do_sample", False) or request.get("do_sample", False)
    keys = sorted((set(manager) | set(request)) - PER_REQUEST - (set() if sampled else SAMPLING))

    def meant(side: dict, key: str):  # what `side` asks for: an unset key as generate reads it, an option off as unset
        value = side.get(key, defaults.get(key))
        return None if key in OFF_AS_UNSET and value is False else value

    differ = {k: (meant(request, k), meant(manager, k)) for k in keys if meant(request, k) != meant(manager, k)}
    if not differ:
        return None
    listed = ", ".join(f"{k}={mine!r} (the manager's: {theirs!r})" for k, (mine, theirs) in list(differ.items())[:6])
    return (f"this request asks for {listed}: with --continuous-batching, every request decodes with the settings of "
            f"{started_by}; a request may change only max_tokens, its EOS and seed{also}. Send the same settings, or "
            "serve without --continuous-batching for per-request settings.")


def install() -> type:
    """Make the server's `GenerationState` build `LoopServingManager` for continuous batching; returns the class."""
    from fastapi import HTTPException
    from transformers.cli.serving import utils

    original = getattr(utils.CBGenerateManager, "wrapped", utils.CBGenerateManager)

    class LoopServingManager(original):
        """transformers' `CBGenerateManager`, with HTTP 400 for what the manager cannot serve (module docstring)."""

        wrapped = original

        def init_cb(self, model, gen_config) -> None:
            try:
                super().init_cb(model, gen_config)
            except ValueError as error:
                raise HTTPException(status_code=400, detail=str(error)) from None
            problem = settings_problem(model.generation_config, self._cb.generation_config, gen_config,
                                       recurrence=self._cb.settings.recurrence)
            if problem:
                raise HTTPException(status_code=400, detail=problem)

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            try:
                return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
            except utils.CBWorkerDeadError:
                raise
            except RuntimeError as error:
                raise HTTPException(status_code=400, detail=served_advice(str(error))) from None

    utils.CBGenerateManager = LoopServingManager
    return LoopServingManager
