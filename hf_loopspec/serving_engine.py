"""`hf-loopspec serve` on transformers >= 5.25, whose server runs each model in a process of its own (spawned: it
imports transformers afresh, so nothing patched in the server's process reaches it).

transformers' `Serve` builds its `ModelLoader` (`transformers.cli.serving.model_manager`), which the model's process
receives pickled and loads the model with; `install` makes that loader `LoopModelLoader`, a subclass defined here, so
the model's process imports this module, and the loader makes the package's class resolvable there
(`serving.expose_architecture`) before loading. With `--continuous-batching`, the model's process starts one manager
(`model.init_continuous_batching`) with the checkpoint's generation config as it loads, and its `CBGenerateRunner`
forwards each request's `max_new_tokens`, EOS ids and sampling settings; `LoopBatchingRunner` forwards
`max_new_tokens`, EOS and seeds drawn from the request's `seed` (`request_seeds`; a Huginn-family request's own
`init_seed` over them), and refuses (HTTP 400, with the reason) a request whose other settings differ from the
manager's (`serving_batching.settings_problem`).
"""

from __future__ import annotations

from transformers.cli.serving import model_manager, utils

from .serving_batching import settings_problem

# what the server, not the request, adds to every request's settings: `--compile` asks for a static cache, which
# continuous batching, with a cache of its own, leaves unused (as transformers' own runner does)
SERVER_SET = frozenset({"cache_implementation"})
REQUEST_SEEDS = "loopspec_request_seeds"  # `generate` passes a request's seeds (`request_seeds`) on under this key


class LoopBatchingRunner(utils.CBGenerateRunner):
    """transformers' continuous-batching runner, forwarding what the package's manager takes per request."""

    def generate(self, request_id: int, inputs: dict, generation_kwargs: dict, stream: bool) -> None:
        from .generation.continuous.settings import eos_ids, request_problem, token_ids

        settings = self.manager.settings  # a request the manager cannot run: an HTTP 400, not a failed request's 500
        eos = generation_kwargs.get("eos_token_id")
        problem = request_problem(settings, token_ids(inputs["input_ids"]), generation_kwargs["max_new_tokens"],
                                  list(settings.eos_token_id) if eos is None else eos_ids(eos), {})
        if problem:
            raise ValueError(problem)
        # transformers' runner would seed torch's global generator, from which the manager's thread draws the seeds
        # of requests that bring none, later and for whatever is in flight: give the request its own seeds instead
        generation_kwargs[REQUEST_SEEDS] = request_seeds(settings, generation_kwargs.pop("seed", None))
        super().generate(request_id, inputs, generation_kwargs, stream)

    def _build_continuous_batching_kwargs(self, generation_kwargs: dict) -> dict:
        from transformers import GenerationConfig

        from .generation.continuous import huginn
        from .models.huginn.recurrence import GENERATION_KEYS, updated

        seeds = generation_kwargs.pop(REQUEST_SEEDS, {})
        recurrence = self.manager.settings.recurrence
        if recurrence is not None:  # checked as generate checks them (a request's 4.0 would compare equal to 4)
            mean = getattr(getattr(self.model, "config", None), "mean_recurrence", recurrence.num_steps)
            updated(recurrence, *(generation_kwargs.get(key) for key in GENERATION_KEYS), mean)
        if recurrence is not None and generation_kwargs.get(huginn.REQUEST_KEY) is not None:
            # a Huginn-family request's own init_seed keys its initial states, as `generate(..., init_seed=S)`
            seeds = {**seeds, huginn.REQUEST_KEY: generation_kwargs.pop(huginn.REQUEST_KEY)}  # (checked above)
        model_config = self.model.generation_config
        request = GenerationConfig(**{key: value for key, value in generation_kwargs.items()
                                      if value is not None and key not in SERVER_SET})
        problem = settings_problem(model_config, self.manager.generation_config, request,
                                   started_by="the checkpoint's generation config, which started the manager",
                                   recurrence=recurrence, also=" (and its init_seed)" if recurrence is not None else "")
        if problem:
            raise ValueError(problem)  # the request's fault: an HTTP 400 with the reason
        return {**{key: generation_kwargs[key] for key in ("max_new_tokens", "eos_token_id")}, **seeds}

    def state(self) -> tuple[int, int, str]:
        with self.lock:
            return len(self.active_requests), 0, ""


def request_seeds(settings, seed: int | None) -> dict:
    """The per-request seeds (`add_request` keys) that make a request's tokens depend only on its `seed`, as they
    do without continuous batching: the sampling seed on a sampling manager, and a Huginn-family request's
    `init_seed` when its initial states are random and the manager has no seed of its own for them. Both are drawn
    from a generator seeded with `seed`; nothing for a request without one, or a manager that uses no randomness."""
    import torch

    if seed is None:
        return {}
    draws = torch.Generator().manual_seed(seed)
    seeds = {"seed": int(torch.randint(2**62, (), generator=draws))} if settings.do_sample else {}
    recurrence = settings.recurrence
    if recurrence is not None and recurrence.init_scale > 0 and recurrence.init_seed is None:
        seeds["init_seed"] = int(torch.randint(2**62, (), generator=draws))
    return seeds


class LoopModelLoader(model_manager.ModelLoader):
    """transformers' `ModelLoader`, which makes the package's class resolvable in the process that loads, and gives
    it the torch threads of the server's process (`--threads`, which `serving.start` sets before `Serve` builds the
    loader)."""

    def __init__(self, *args, **kwargs):
        import torch

        super().__init__(*args, **kwargs)
        self.threads = torch.get_num_threads()  # an attribute: it travels, pickled, to the model's process

    def load_model_and_processor(self, model_id: str, on_progress=None):
        import torch

        from .serving import expose_architecture

        torch.set_num_threads(self.threads)
        repo, _, _ = utils.parse_model_id(model_id)
        expose_architecture(repo, self.trust_remote_code)
        model_manager.CBGenerateRunner = LoopBatchingRunner  # this process's (the model's) runner
        return super().load_model_and_processor(model_id, on_progress)


def install() -> None:
    """Make transformers' `Serve` load models with `LoopModelLoader`."""
    model_manager.ModelLoader = LoopModelLoader
