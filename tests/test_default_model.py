"""The embedded default model (`hf_loopspec/assets/default_model/`): loads offline, is a 4-loop Ouro, fits the
size budget, its tokenizer round-trips, every loop predicts held-out stdlib code far better than chance,
pipelined self-speculation reproduces plain greedy decoding, and the README's main command (and the four
other prompts its card shows, with the same settings) does not fall into degenerate repetition."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import shlex
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from processes import ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

import hf_loopspec  # noqa: F401  (registers the Ouro classes with the Auto factories)
from hf_loopspec import OuroForCausalLM, cli
from hf_loopspec.assets import default_model_path
from hf_loopspec.generation.auto_costs import Candidate, CostTable, set_costs
from hf_loopspec.generation.auto_policy import forget
from hf_loopspec.prompting import encode_prompt, generate_kwargs

MAX_BYTES = 25 * 10**6
CARD_MEASUREMENTS = ROOT / "model_cards" / "hf-loopspec-default" / "measurements.json"
CHECKED_TOKENS = 64


def _measure_script():
    script = ROOT / "scripts" / "measure_default_model.py"
    spec = importlib.util.spec_from_file_location("measure_default_model", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_MEASURE = _measure_script()
repeated_block, SHOWCASE_PROMPTS = _MEASURE.repeated_block, _MEASURE.SHOWCASE_PROMPTS
SNIPPET_TOKENS = 192
FALLBACK_SNIPPET = '''def _splitext(p, sep, altsep, extsep):
    """Split the extension from a pathname."""
    sepIndex = p.rfind(sep)
    if altsep:
        altsepIndex = p.rfind(altsep)
        sepIndex = max(sepIndex, altsepIndex)

    dotIndex = p.rfind(extsep)
    if dotIndex > sepIndex:
        # skip all leading dots
        filenameIndex = sepIndex + 1
        while filenameIndex < dotIndex:
            if p[filenameIndex:filenameIndex+1] != extsep:
                return p[:dotIndex], p[dotIndex:]
            filenameIndex += 1

    return p, p[:0]
'''


@pytest.fixture(scope="module")
def folder() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_loads_as_four_loop_ouro(model, tokenizer):
    assert isinstance(model, OuroForCausalLM)
    assert model.config.total_ut_steps == 4 and model.num_loops == 4
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == model.config.eos_token_id == 0
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    gen = model.generation_config
    assert (gen.speculative_mode, gen.draft_loops, gen.num_speculative_tokens) == ("auto", 1, 4)
    assert gen.eos_token_id == 0 and gen.pad_token_id == 0


def test_size_on_disk(folder):
    files = [f for f in folder.iterdir() if f.is_file()]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "training_report.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) <= MAX_BYTES


def test_missing_folder_raises_clear_error(monkeypatch, tmp_path):
    from hf_loopspec import assets

    monkeypatch.setattr(assets, "DEFAULT_MODEL_DIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="default model is missing"):
        assets.default_model_path()


@pytest.mark.parametrize("text", [
    FALLBACK_SNIPPET,
    "x = {'a': [1, 2.5e-3, None]}\t# tab, ünïcödé, emoji \U0001F40D and CRLF\r\n",
    "<|im_start|>user\nhi<|im_end|>",
])
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def held_out_snippets(folder: Path, tokenizer, count: int = 3) -> list[list[int]]:
    """The first tokens of a few files the model never trained on (from its training report), plus a fixed one."""
    report = json.loads((folder / "training_report.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [FALLBACK_SNIPPET]
    for rel in report["corpus"]["validation_file_list"]:
        if len(texts) > count:
            break
        path = root / rel
        if path.is_file() and path.stat().st_size > 4000:
            texts.append(path.read_text(encoding="utf-8", errors="replace")[:4000])
    return [tokenizer(t, add_special_tokens=False).input_ids[:SNIPPET_TOKENS] for t in texts]


def test_every_loop_is_far_below_uniform(model, tokenizer, folder):
    uniform = math.log(model.config.vocab_size)
    losses = torch.zeros(model.num_loops)
    snippets = held_out_snippets(folder, tokenizer)
    with torch.no_grad():
        for ids in snippets:
            ids = torch.tensor([ids])
            out = model(input_ids=ids[:, :-1], use_cache=False, output_loop_logits=True)
            for u, logits in enumerate(out.loop_logits):
                losses[u] += F.cross_entropy(logits[0], ids[0, 1:]) / len(snippets)
    # The threshold is far above what a trained model scores (the card's validation loss) and far below chance.
    assert (losses < 0.65 * uniform).all(), (losses.tolist(), uniform)


def test_pipeline_equals_plain_greedy(model, tokenizer):
    inputs = tokenizer("def fibonacci(n):\n", return_tensors="pt")
    with torch.no_grad():
        plain = model.generate(**inputs, max_new_tokens=24, do_sample=False, speculative_mode=None)
        spec = model.generate(**inputs, max_new_tokens=24, do_sample=False, speculative_mode="pipeline",
                              draft_loops=1, return_dict_in_generate=True)
    assert spec.sequences.tolist() == plain.tolist()
    stats = spec.speculation
    assert stats.verified > 0 and stats.core_calls_per_token < model.num_loops


# auto's choice for a call, pinned (as test_auto does): an engine cycle at 0.45 of a plain step lets the first call
# probe pipeline (no acceptance remembered: `forget`); at 1.0 no speculative setting can beat plain decoding
AUTO_PICKS = {"speculative": 0.45, "plain": 1.0}


@pytest.mark.parametrize("mode", [None, "pipeline", "block", "auto-speculative", "auto-plain"])
def test_token_healing_decodes_as_plain_or_refuses_a_mask_it_no_longer_fits(model, tokenizer, mode):
    """transformers' `token_healing` rewrites the prompt; in a padded batch it can narrow it and leave the mask as it
    was, which the model's forward refused without naming token_healing and the speculative modes read row by row
    (an IndexError). Every mode refuses it with one message, auto whichever decoder it picks for the call (its
    choice depends on acceptance remembered from earlier calls and on timed costs). One prompt heals and decodes as
    plain decoding does."""
    auto_pick = mode.split("-")[1] if mode and mode.startswith("auto") else None
    mode = "auto" if auto_pick else mode
    ratio = AUTO_PICKS[auto_pick or "speculative"]
    set_costs(model, CostTable(1.0, {Candidate("pipeline", 1): ratio, Candidate("block", 1, 4): ratio}))
    forget(model)
    settings = {"max_new_tokens": 8, "do_sample": False, "token_healing": True, "tokenizer": tokenizer}
    one = tokenizer(["The link is http://www"], return_tensors="pt")
    batch_tokenizer = copy.copy(tokenizer)
    batch_tokenizer.padding_side = "left"
    batch = batch_tokenizer(["The link is http://www", "Hello, my name is", "Once upon a time in a land far away "
                             "there "], return_tensors="pt", padding=True)
    try:
        with torch.no_grad():
            assert torch.equal(model.generate(**one, **settings, speculative_mode=mode),
                               model.generate(**one, **settings, speculative_mode=None))
            forget(model)  # (the batch call then starts as the first did)
            with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 18\), but the prompt decoding starts "
                                                 r"from has shape \(3, 17\) \(token_healing rewrote it"):
                model.generate(**batch, **settings | {"tokenizer": batch_tokenizer}, speculative_mode=mode)
    finally:
        forget(model)
        set_costs(model, None)


class StopsRowAt(StoppingCriteria):
    """A call's own criterion: row `row` is done once it has `new` new tokens after the `width` prompt columns."""

    def __init__(self, width: int, row: int, new: int):
        self.width, self.row, self.new = width, row, new

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] - self.width >= self.new
        return done


@pytest.mark.parametrize("criterion", [False, True], ids=["stop-strings", "a-criterion"])
def test_auto_counts_a_plain_stretchs_rows_to_where_they_stopped(model, tokenizer, criterion):
    """A call with stop strings, or a stopping criterion of its own, decodes in one stretch; plain wins it. The
    model pads with its EOS id, so a row they stopped was counted one padding token past its end (and the docs said
    such a row counted to the stretch's end). Each row's `committed` is now its new tokens up to the first column at
    which its text holds a stop string, or the criterion stops it, or EOS: what the pipeline mode reports."""
    set_costs(model, CostTable(1.0, {Candidate("pipeline", 1): 5.0, Candidate("block", 1, 4): 5.0}))  # plain wins
    forget(model)
    batch_tokenizer = copy.copy(tokenizer)
    batch_tokenizer.padding_side = "left"
    batch = batch_tokenizer(["def fibonacci(n):", "import os\nclass Foo:", "x = [i for i in range(10)]\n"],
                            return_tensors="pt", padding=True)
    width, stops = batch["input_ids"].shape[1], [] if criterion else ["\n    "]
    settings = {"max_new_tokens": 30, "do_sample": False, "return_dict_in_generate": True}
    settings |= {"stopping_criteria": StoppingCriteriaList([StopsRowAt(width, 0, 4)])} if criterion else {
        "stop_strings": stops, "tokenizer": batch_tokenizer}
    try:
        with torch.no_grad():
            auto = model.generate(**batch, **settings, speculative_mode="auto")
            pipeline = model.generate(**batch, **settings, speculative_mode="pipeline")
    finally:
        forget(model)
        set_costs(model, None)
    assert [c.mode for c in auto.speculation.choices] == ["plain"]
    assert torch.equal(auto.sequences, pipeline.sequences)
    counts = [s.committed for s in auto.speculation.per_sequence]
    assert counts == [s.committed for s in pipeline.speculation.per_sequence]
    eos = model.generation_config.eos_token_id
    assert model.generation_config.pad_token_id in (eos if isinstance(eos, list) else [eos])  # (what made it wrong)
    for b, row in enumerate(auto.sequences[:, width:].tolist()):  # where each row stops, counted independently
        text = [tokenizer.decode(row[:n]) for n in range(1, len(row) + 1)]
        ends = [n for n in range(1, len(row) + 1) if any(stop in text[n - 1] for stop in stops) or row[n - 1] in
                (eos if isinstance(eos, list) else [eos]) or (criterion and b == 0 and n == 4)] + [len(row)]
        assert counts[b] == ends[0], (b, counts, row)
    assert min(counts) < auto.sequences.shape[1] - width  # a row stopped before the stretch's end


def test_token_healing_leaves_a_padded_batch_of_inputs_embeds_as_it_is(model, tokenizer):
    """With `inputs_embeds` transformers heals no prompt (decoding starts from no ids): a padded batch decodes as it
    does without token_healing (the healed-mask check refused it, naming a rewrite that never happened)."""
    batch_tokenizer = copy.copy(tokenizer)
    batch_tokenizer.padding_side = "left"
    batch = batch_tokenizer(["The link is http://www", "Hello"], return_tensors="pt", padding=True)
    inputs = {"inputs_embeds": model.get_input_embeddings()(batch["input_ids"]),
              "attention_mask": batch["attention_mask"], "max_new_tokens": 6, "do_sample": False}
    with torch.no_grad():
        healed = model.generate(**inputs, token_healing=True, tokenizer=batch_tokenizer, speculative_mode=None)
        assert torch.equal(healed, model.generate(**inputs, speculative_mode=None))


def test_generation_config_leaves_the_length_to_the_caller(model, tokenizer, folder):
    """No length limit in generation_config.json: a caller's `max_length` (as lm-eval passes it) is what binds."""
    stored = json.loads((folder / "generation_config.json").read_text())
    assert "max_new_tokens" not in stored and "max_length" not in stored
    inputs = tokenizer("import os\n", return_tensors="pt")
    limit = inputs["input_ids"].shape[-1] + 10
    with torch.no_grad():  # min_new_tokens keeps EOS out, so the length is exactly the caller's limit
        out = model.generate(**inputs, max_length=limit, min_new_tokens=10)
    assert out.shape[-1] == limit


def readme_main_command() -> list[str]:
    """The arguments after `hf-loopspec` of the README's main command (the first set-up block)."""
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if "&& hf-loopspec generate " in line:
            return shlex.split(line.split("&& hf-loopspec ", 1)[1])
    raise AssertionError("README.md has no `... && hf-loopspec generate ...` command")


def test_repeated_block_definition():
    assert repeated_block([5, 1, 2, 1, 2, 1, 2, 9]) == (1, 2)
    assert repeated_block([7] * 6) == (0, 2) and repeated_block([7] * 5) is None
    assert repeated_block([1, 2, 1, 2, 3, 1, 2]) is None and repeated_block(list(range(64))) is None


@pytest.mark.parametrize("index", range(len(SHOWCASE_PROMPTS)))
def test_readme_settings_do_not_loop(model, tokenizer, index):
    """The README's main command, run for its first 64 tokens on the README's prompt and on the card's other
    showcase prompts: plain greedy decoding with the command's settings has no degenerate repetition, and the
    command's speculative mode prints exactly the same tokens."""
    args = cli.build_parser().parse_args(readme_main_command())
    assert args.command == "generate" and args.model == "default" and not args.do_sample
    assert SHOWCASE_PROMPTS[0] == args.prompt  # the card shows the README's prompt first
    args.max_new_tokens = CHECKED_TOKENS
    kwargs = generate_kwargs(args, model, tokenizer)
    card = json.loads(CARD_MEASUREMENTS.read_text())["showcase"]
    assert [sample["prompt"] for sample in card["samples"]] == SHOWCASE_PROMPTS
    assert card["settings"].get("repetition_penalty") == kwargs.get("repetition_penalty")
    ids = torch.tensor([encode_prompt(tokenizer, SHOWCASE_PROMPTS[index], args.chat)])
    with torch.no_grad():
        plain = model.generate(input_ids=ids, **{**kwargs, "speculative_mode": None})
        spec = model.generate(input_ids=ids, **kwargs)
    new = plain[0, ids.shape[1]:].tolist()
    assert len(new) == CHECKED_TOKENS or new[-1] == tokenizer.eos_token_id
    assert spec.tolist() == plain.tolist()
    found = repeated_block(new)
    assert found is None, (found, tokenizer.decode(new))
