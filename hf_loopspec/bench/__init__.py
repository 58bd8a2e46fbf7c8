"""`hf-loopspec bench`: plain vs AR vs block vs pipeline decoding in one process, with the limit it is judged by.

Modules: `args` (the command's arguments), `shapes` (random-weight models), `prompts`, `run` (one timed run of one
mode and its check), `costs` (call-cost calibration and the cost model), `report` (the JSON document, whose schema
it owns, and the table), `plot`, `main` (`run_bench`, the entry points). Model loading is `hf_loopspec.loading`.

What runs
---------
Four modes over the same greedy prompts (`--batch-size` sequences of `--prompt-len` tokens, `--new-tokens`
new tokens each; EOS is ignored in every mode, so every run commits exactly `batch * new_tokens` tokens). The
prompts are seeded random ids for random weights, else slices of a built-in text (`PROMPT_CODE`, Python source,
for the embedded model, which was trained on Python; `PROMPT_TEXT`, English, for other checkpoints) or of
`--prompt-file`.

* `plain`: `model.generate(..., speculative_mode=None)`, transformers' own loop on a `DynamicCache`.
* `static` (only when asked for in `--modes`): the same with `cache_implementation="static"`, which transformers
  compiles on CUDA (its own fast path, the honest plain baseline on a GPU); its `compile_seconds` is its warm-up
  minus its median timed run.
* `ar`: the wavefront engine in mode "ar" on a `PagedLoopCache`: no drafting, U core calls per token. The baseline
  of the speculative modes (same engine, same cache).
* `block`, `pipeline`: the wavefront engine (`WavefrontEngine.from_request`, what `generate` runs) in that mode.
* `pipeline+second` (with `--second-draft-loops D2`): pipeline with second proposals from loop D2
  (`second_draft_loops`, D2 >= U - d), once per `--engines` engine; its rows add `second_drafts` and
  `second_accepted`.

`plain` is also run once, untimed, first: its greedy output is the reference. Every mode is then warmed up once,
and the timed runs are interleaved (`plain ar block pipeline plain ar ...`, `--repeats` rounds); a mode's time is
the median of its rounds and includes prefill. Every output of every timed run (not the warm-up's) is compared
with the reference: in fp32 it must be equal (`check_passed`), in bf16/fp16 the agreement rate (common-prefix
fraction) is reported with the first divergent token and the reference's top-1/top-2 logit margin there.

Random-weight shapes (`SHAPES`) cover both families: `ouro-tiny`, `ouro-100m`, `ouro-1.4b`, and `huginn-tiny`,
`huginn-small` (Huginn-0125's 2 + 4 + 2 stage layout at width 512, 32 recurrence steps), `huginn-3.5b` (the real
shape, for a GPU). Huginn-family models run every mode from zero initial states (init_scale 0) at the checkpoint's
steps (its generation config's `num_steps`, else `mean_recurrence`); `draft_loops` then counts recurrence steps.
Their prelude (`embed`) and coda (`head`) have KV of their own: the call-cost model below times them on their own
planes.

`--compile [BACKEND]` runs the wavefront engine's step compiled (`compile_core`, fullgraph); each row reports
`compile_seconds`, its warm-up run minus its median timed run.

`--engines wavefront,reference` also runs every lane mode (ar, block, pipeline) on the reference, the lane decoder
(`model.decode_with_lanes`, eager only), as a measured baseline: it is the tests' oracle, not an engine `generate`
runs. Its rows are named `MODE/reference`; every JSON row carries `engine` ("wavefront", "reference", or None for
plain modes and auto, whose segments are plain or speculative: its `auto_choices` say which). The wavefront engine's
call rows are the fixed shapes it runs (every lane slot and prompt row in each core call, masked or not); with
`--synthetic-acceptance` its draft override is filled from the same seeded hook position by position: each
(sequence, position) has one synthetic draft, so both engines see the same pattern.

`--synthetic-acceptance A` (for random weights, whose drafts are almost never right): every draft proposal is
replaced through `draft_hook` by the known greedy token with probability A (seeded), otherwise by a wrong token.
Verification stays real, so outputs must still equal the reference. The known token comes from the mode's own
warm-up output: in fp32 that equals the reference (the timed runs' checks confirm it); in bf16 it keeps the
acceptance at A after a rounding divergence from plain decoding.

The limit it is judged against
------------------------------
In every round, before its runs (so that both see the same machine load), one call of each stage of the
`LoopedModel` protocol (`core`, `head`, `embed`, over a `PagedLoopCache` `RowBatch` at context `prompt_len`) is
timed for the row counts the strategies use: t(R) for R = 1, B, 2B, ..., max(U/d, K+1)*B core rows, the causal
prefill call t_pre over P*B rows (B = batch, P = prompt length); the head h(M) and embed e(M) likewise; each is
the median over the rounds (`costs`). Every lane run counts the rows of each of its stage calls on the host
(`SpeculationStats.call_rows`; nothing in a timed run waits for the device). If nothing but these calls cost
time, a run would take

    T_hat(mode) = sum_i t(R_i) + sum_j h(M_j) + sum_k e(E_k)   (interpolated piecewise-linearly between points)

For `ar` with N new tokens that is U prefill calls, (N-1)*U calls of B rows, N head calls of B rows (Ouro) and
the embedding of the prompt and of N-1 tokens:

    T_hat(ar) = U*t_pre + (N-1)*U*t(B) + N*h(B) + e_pre + (N-1)*e(B)

That formula is the baseline when `ar` is not in `--modes`. When it is, T_hat(ar) is the `ar` run's own calls, so
that its row's ideal is 1 and `fraction_of_ideal` divides two speed-ups over the same run; the engine's `ar` runs
the head and the embedding every cycle, more calls than the formula counts, so one run's ideal differs with and
without `ar` in `--modes` (most where the head is costly: Huginn's coda). The reported limit is

    ideal_speedup_vs_ar = T_hat(ar) / T_hat(mode)
    fraction_of_ideal   = speedup_vs_ar / ideal_speedup_vs_ar      (speedup_vs_ar = T(ar) / T(mode), measured)
    overhead_fraction   = 1 - T_hat(mode) / T(mode)               (time outside embed, core, head calls: Python,
                                                                    cache bookkeeping, row planning)

The counters, T_hat(mode) and T(mode) of the last two are one run's, the round whose time is the median (auto's
calls may choose differently from round to round). The call costs are eager calls: with `--compile` a compiled
row's overhead is not reported (eager costs cannot split a compiled run's time), and its ideal speed-up stays
the eager cost model's ratio.

In steady state (N large, prefill negligible, c = decode core calls per token of one sequence) this is the
per-token form: for the pipeline (every call runs ceil(U/d) lanes per sequence, one head call per d calls with
a target and a draft row per sequence)

    (U*t(B) + h(B)) / (c*t(ceil(U/d)*B) + (c/d)*h(2B)),      c = d + (U-d)(1-a)   (docs/design.md, "Cost model")

and for block (a round = (K+1)d draft calls of B rows, K draft heads of B rows, U-d verify calls and one verify
head of (K+1)B rows; r = c / ((K+1)d + U - d) rounds per token)

    (U*t(B) + h(B)) / (r * [(K+1)d*t(B) + (U-d)*t((K+1)B) + K*h(B) + h((K+1)B)]).

On a GPU at small batch t(R) is nearly flat in R, so the pipeline's limit approaches U/c; on a CPU t(R) grows
with R and the limit is lower. The measured call costs are in the JSON (`call_costs`).

Memory (`peak_mem_bytes`): on CUDA `torch.cuda.max_memory_allocated` over the run (weights included); on CPU
the parameter bytes plus the KV cache's allocated bytes (the `PagedLoopCache` pool, which grows by doubling, or
the `DynamicCache` tensors) at the end of the run (`peak_mem_kind` says which).

Sampling (`--do-sample`)
------------------------
With `--do-sample` (and `--temperature`, default 1.0, `--top-p`, default 1.0, `--top-k`, default 0 = off) every
mode samples: `plain` through `model.generate(do_sample=True, temperature=..., top_p=..., top_k=...)`, the lane
modes with `do_sample=True` and the processors that generate builds
from the same settings, built by transformers' own code (`run.generation_processors`). The bench runs on a
generation config of its own (no EOS, none of a checkpoint's generation defaults) and leaves the caller's
`model.generation_config` as it was. Drafts are judged by lossless
speculative sampling (accept with min(1, p/q), else draw from the residual), so `acceptance_rate` is that real
acceptance, not a greedy match. Every run is seeded with `torch.manual_seed(seed + round)` (warm-ups with
`seed`), so a bench repeats. The outputs are random draws: they are not compared token by token with plain
(`check: {"exact": null, "note": ...}`, `check_passed: null`; the exit status stays 0); that the speculative
modes sample the same distribution as plain is tested in `tests/test_speculative_sampling.py`. Sampled runs
differ from round to round, so the counters, calls/token and the ideal speed-up are the median-time round's (as
with greedy decoding) and `acceptance_rate_all` / `core_calls_per_token_all` list every round's. The untimed
first plain run is then only a warm-up. `--synthetic-acceptance` is refused with `--do-sample`: it replaces drafts
by *the known greedy token*, and sampling has no known token to replace them by.
"""


def __getattr__(name: str):
    # `from hf_loopspec.bench import run_bench`, without importing the orchestration (and the model loading it
    # needs) for users of `hf_loopspec.bench.shapes` alone.
    if name == "run_bench":
        from .main import run_bench

        return run_bench
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
