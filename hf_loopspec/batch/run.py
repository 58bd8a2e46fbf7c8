"""`hf-loopspec batch`: one process, or data-parallel under `accelerate launch`.

Every process reads and checks the whole input, loads the model and tokenizes every prompt (bad input fails in
every process alike, before anything is generated), plans the same length-grouped batches, and takes its shard
of them with `accelerate`'s `PartialState.split_between_processes`. It appends each finished batch to its own
part file (`parts.PartStore`); when every process is done, the main process merges the parts into OUT in input
order. Before any model loads, the main process refuses links in OUT's paths, takes the run's lock on `OUT.parts/`
(held until OUT is written) and compares the settings of an unfinished run with this one's (the weights' fingerprint
included); what it refuses, every process refuses with the same message. A tqdm bar on the main process shows the
whole run's rows, tokens/s and acceptance rate (`progress.RunProgress`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from .. import loading
from ..input_checks import check_positions
from ..prompting import SAMPLING_KEYS, encode_prompt, generate_kwargs, saved_stop_criterion
from .fingerprint import weights_fingerprint
from .parts import PartStore
from .progress import RunProgress
from .prompts import PromptRow, id_key, plan_batches, read_prompts
from .readers import quiet_logger

# A process that finishes its shard early waits for the others at the final barrier; allow long shards.
BARRIER_TIMEOUT = timedelta(hours=24)
WORLD_SIZE_KEYS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
SETTING_KEYS = ("field", "model", "mode", "draft_loops", "num_speculative_tokens", "max_new_tokens", "batch_size",
                "chat", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "dtype")


def run_settings(args: argparse.Namespace) -> dict:
    """What the output depends on: the input file's SHA-256, the options that change what is generated and the
    weights' fingerprint (`fingerprint.weights_fingerprint`; None for a Hub id until it is loaded)."""
    digest = hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest()
    unread = () if args.do_sample else SAMPLING_KEYS  # (greedy: at their off values at most, and not passed on)
    return {"input_sha256": digest, **{key: None if key in unread else getattr(args, key) for key in SETTING_KEYS},
            "weights": weights_fingerprint(args.model), "generation_config": None}


def saved_generation(model) -> dict:
    """What the loaded checkpoint's generation config sets (apart from transformers' defaults and the version that
    wrote it), as its JSON reads back: the output depends on it (stop strings, EOS and pad ids, speculative settings),
    so a resume under another is refused (`run_settings` records it once the model is loaded)."""
    saved = json.loads(model.generation_config.to_json_string(use_diff=True))
    saved.pop("transformers_version", None)
    return saved


def decode_batch(model, tokenizer, prompts: list[list[int]], kwargs: dict) -> list[dict]:
    """Generate for one batch of token-id prompts (left-padded together); one result dict per prompt, in order.

    A row's output ends at its first EOS (kept in `new_tokens`, not in the text, even when the EOS id is an ordinary
    word of the tokenizer) or at the token that completes one of the checkpoint's saved stop strings (kept in both),
    whichever comes first; what follows is the pad that `generate` fills a finished row with. Stop strings are judged
    on each row without its padding (`UnpaddedStopStrings`), so a row ends where its prompt alone would, whatever
    the batch. `stop` says whether it ended at EOS, at a stop string or at the length limit; `speculation` holds its
    counters (`SequenceStats`) in the speculative modes. The batch is padded with the pad id `generate` uses
    (`kwargs`' from `prompting.generate_kwargs`, else the generation config's, else 0), not the tokenizer's: a
    tokenizer may have no pad token, or one outside the model's vocabulary.
    """
    pad = kwargs["pad_token_id"] if "pad_token_id" in kwargs else model.generation_config.pad_token_id
    enc = left_pad(prompts, 0 if pad is None else pad, model.device)
    width = enc["input_ids"].shape[-1]
    criterion = saved_stop_criterion(model, tokenizer)
    stops = None if criterion is None else UnpaddedStopStrings(criterion, [width - len(ids) for ids in prompts])
    with torch.inference_mode():  # (the saved stop strings judged by `stops` instead of transformers' criterion)
        out = model.generate(**enc, **kwargs, return_dict_in_generate=True, **({} if stops is None else {
            "stop_strings": None, "stopping_criteria": StoppingCriteriaList([stops])}))
    new = out.sequences[:, width:]  # [batch, new]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    completed = stop_string_ends(out.sequences, width, stops)
    stats = getattr(out, "speculation", None)
    results = []
    for row, tokens in enumerate(new.tolist()):
        at_eos = next((i for i, token in enumerate(tokens) if token in eos), len(tokens))
        at_string = completed[row] if completed[row] is not None and completed[row] < at_eos else None
        end = at_eos if at_string is None else at_string + 1  # (the EOS is left out of the text)
        stop = "stop_string" if at_string is not None else "eos" if at_eos < len(tokens) else "length"
        result = {"completion": tokenizer.decode(tokens[:end], skip_special_tokens=True),
                  "new_tokens": end + (stop == "eos"), "stop": stop}
        if stats is not None:  # (a fixed mode that decoded plainly has no counters: its reason instead)
            result["speculation"] = asdict(stats.per_sequence[row]) if stats.per_sequence else \
                {"fallback": stats.fallback}
        results.append(result)
    return results


class UnpaddedStopStrings(StoppingCriteria):
    """transformers' `StopStringCriteria` (`criterion`) judged on each row of a left-padded batch without its `pads`
    (per row, the pad columns before its prompt), as `generate` judges a prompt decoded alone: transformers' own
    judging of the padded batch reads the pad ids before a short prompt as text (a stop string could end in them)."""

    def __init__(self, criterion, pads: list[int]):
        self.criterion, self.pads = criterion, pads

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:  # [batch] bool
        return torch.cat([self.criterion(input_ids[row:row + 1, pad:], scores) for row, pad in enumerate(self.pads)])


def stop_string_ends(sequences: torch.Tensor, width: int, stops) -> list[int | None]:
    """Per row of `sequences` ([batch, width + new]: prompts `width` wide), the index among its new tokens of the first
    that `stops` (`UnpaddedStopStrings`; None: no stop strings) stops at, judged on the sequence up to that token as
    `generate` judged it, or None."""
    found: list[int | None] = [None] * sequences.shape[0]
    for index in range(sequences.shape[1] - width if stops is not None else 0):
        hits = stops(sequences[:, :width + index + 1], None).tolist()
        found = [index if hit and first is None else first for first, hit in zip(found, hits)]
    return found


def left_pad(prompts: list[list[int]], pad_id: int, device) -> dict:
    """`input_ids` and `attention_mask` ([batch, longest prompt], on `device`) of `prompts` left-padded with `pad_id`
    (masked out: any id in the model's vocabulary does)."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        if ids:
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def process_state():
    """accelerate's `PartialState` for this process, on the CPU (gloo) when asked for or when there is no GPU.

    `accelerate launch --cpu` starts a single process (its multi-CPU launch goes through mpirun with a hostfile),
    and a multi-process launch without a GPU (`accelerate launch --multi_gpu`, `torchrun`) is only distributed if
    the state is made with `cpu=True`; without it every process would believe it is alone and redo all rows.
    """
    from accelerate import PartialState
    from accelerate.utils import get_int_from_env, parse_flag_from_env

    world_size = get_int_from_env(WORLD_SIZE_KEYS, 1)  # torchrun / accelerate launch, or an MPI launcher
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows every device type
    has_accelerator = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or (world_size > 1 and not has_accelerator)
    state = PartialState(cpu=cpu, timeout=BARRIER_TIMEOUT)
    if state.num_processes != world_size:
        raise ValueError(f"this process was launched as one of {world_size}, but accelerate runs "
                         f"{state.num_processes}; launch with `accelerate launch --num_processes N -m "
                         "hf_loopspec.cli batch ...`.")
    return state


def on_main_process(state, check) -> None:
    """Run `check()` on the main process only; the `ValueError` / `OSError` it raises is raised in every process (one
    that went on alone would wait for the main process at the next barrier), the other processes' with its message
    and the `keys` the CLI leaves unspelled (`OtherSettingsError`: a generation config's keys, not options)."""
    error = None
    if state.is_main_process:
        try:
            check()
        except (ValueError, OSError) as err:
            error = err
    message, keys = None if error is None else str(error), tuple(getattr(error, "keys", ()))
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        message, keys = broadcast_object_list([message, keys])
    if error is not None:
        raise error
    if message is not None:
        forwarded = ValueError(message)
        forwarded.keys = keys  # (what the CLI leaves unspelled)
        raise forwarded


def encode_prompts(prompts: list[PromptRow], model, tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """Every prompt's token ids; `ValueError` naming the row for one that is empty or too long for the model (the
    tokenizer's own too-long warning is silenced: the positions check says it in the error instead)."""
    encoded = []
    with quiet_logger("transformers.tokenization_utils_base", logging.ERROR):
        for prompt in prompts:
            where = f"the prompt on {prompt.where}"
            encoded.append(encode_prompt(tokenizer, prompt.prompt, args.chat, where))
            check_positions(model.config, len(encoded[-1]), args.max_new_tokens, prompt_flag=where,
                            new_flag="--max-new-tokens")
    return encoded


def decode_shard(progress: RunProgress, store: PartStore, todo: list[tuple[int, list[int]]],
                 prompts: list[PromptRow], encoded: list[list[int]], done: set[str], model, tokenizer, kwargs: dict,
                 seed: int | None) -> None:
    """Decode this process's unfinished batches (`(batch number, row indices)`), appending each to its part file
    (rows already done are not written twice) and polling the progress bar after each."""
    with store.open() as part:
        for index, rows in todo:
            if seed is not None:  # per batch, so sampled rows do not depend on sharding or resuming
                torch.manual_seed(seed + index)
            results = decode_batch(model, tokenizer, [encoded[i] for i in rows], kwargs)
            store.append(part, ({"id": prompts[i].id, **result} for i, result in zip(rows, results)
                                if id_key(prompts[i].id) not in done))
            progress.poll()


def claim_parts(store: PartStore, stack: contextlib.ExitStack) -> None:
    """The main process's checks before anything loads: no links in OUT's paths, the run's lock on `OUT.parts/`
    (held until `stack` closes), and an unfinished run's settings equal to this run's (the generation config and
    weights not known yet excepted)."""
    store.check_paths()
    stack.enter_context(store.lock())
    store.check_settings(unknown=("generation_config",) if store.settings["weights"] is not None else
                         ("weights", "generation_config"))


def load_and_encode(args: argparse.Namespace, state, store: PartStore, prompts: list[PromptRow]):
    """`(model, tokenizer, token ids of every prompt, generate kwargs)`; the checkpoint's generation config and a Hub
    id's weights, known once loaded, are compared with an unfinished run's here."""
    if args.device is not None and state.num_processes > 1:
        raise ValueError(f"--device {args.device} cannot be used with {state.num_processes} processes: accelerate "
                         "places each process on its own device; drop --device.")
    device = state.device if args.device is None else loading.resolve_device(args.device)
    dtype = "auto" if args.dtype == "auto" else loading.DTYPES[args.dtype]
    model, tokenizer, _ = loading.load_model(args.model, dtype, device, need_tokenizer=True)
    if store.settings["weights"] is None:
        store.settings["weights"] = weights_fingerprint(args.model, loaded=True)
    store.settings["generation_config"] = saved_generation(model)
    on_main_process(state, store.check_settings)
    return model, tokenizer, encode_prompts(prompts, model, tokenizer, args), generate_kwargs(args, model, tokenizer)


def run_batch(args: argparse.Namespace) -> int:
    """The command (see the module docstring); exit status 0 once OUT is written."""
    prompts = read_prompts(args.prompts, args.field)
    output = Path(args.output)
    if output.is_dir() or output.resolve() == Path(args.prompts).resolve():
        raise ValueError(f"--output {output} is {'a folder' if output.is_dir() else 'the input file'}; pass the path "
                         "of the JSONL file to write, such as completions.jsonl.")
    state = process_state()
    store = PartStore(output, run_settings(args), state.process_index,
                      names={**{key: "--" + key.replace("_", "-") for key in SETTING_KEYS},  # (mode: --mode)
                             "generation_config": "the checkpoint's generation_config.json"})
    with contextlib.ExitStack() as stack:
        on_main_process(state, lambda: claim_parts(store, stack))
        model, tokenizer, encoded, kwargs = load_and_encode(args, state, store, prompts)
        batches = plan_batches([len(ids) for ids in encoded], args.batch_size)
        if state.is_main_process:
            store.create()
        state.wait_for_everyone()  # the parts folder and its settings exist before any process reads or writes parts
        done = store.finished_ids()
        with state.split_between_processes(list(enumerate(batches))) as shard:
            todo = [(index, rows) for index, rows in shard if any(id_key(prompts[i].id) not in done for i in rows)]
        if state.is_main_process and done:
            print(f"resuming: {len(done)} of {len(prompts)} rows were already done", file=sys.stderr, flush=True)
        with RunProgress(store, len(prompts), len(done), enabled=state.is_main_process,
                         poll_thread=state.num_processes > 1) as progress:
            decode_shard(progress, store, todo, prompts, encoded, done, model, tokenizer, kwargs, args.seed)
            state.wait_for_everyone()  # the bar keeps counting the other processes' rows meanwhile
        if state.is_main_process:
            count = store.merge(prompts)
            processes = "1 process" if state.num_processes == 1 else f"{state.num_processes} processes"
            print(f"wrote {count} rows to {output} ({processes})", file=sys.stderr, flush=True)
    return 0
