"""The command line's contract beyond broken checkpoints (those are `test_cli_errors.py`'s): `--threads` on
`generate` and `batch`, `generate --compare` (plain decoding timed next to the speculative run, the tokens compared),
the option combinations refused before anything loads (sampling options without `--do-sample`, speculative-only
options with `--mode plain`), a checkpoint folder that is no looped model, a PROMPT that is not UTF-8, lm-eval's
missing local folder, and no tokenizer warning ahead of an error line."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from checkpoint_utils import save_checkpoint, word_tokenizer
from cli_utils import command, one_error_line
from processes import ROOT, subprocess_env
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, TopKLogitsWarper

from hf_loopspec import cli, serving
from hf_loopspec.assets import default_model_path
from hf_loopspec.generation.auto_costs import kept_table
from hf_loopspec.prompting import generate_kwargs

POSITIONS = 16


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", seed=1, max_position_embeddings=POSITIONS)


@pytest.fixture
def threads_restored():
    """The test may change torch's thread count through the CLI; the suite's count is put back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# --- --threads ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["generate", "batch"])
def test_threads_sets_torchs_thread_count_and_defaults_to_one(name, good, tmp_path, capsys, threads_restored):
    torch.set_num_threads(3)  # neither the value asked for nor the default, so both assertions can fail
    assert cli.main([*command(name, str(good), tmp_path), "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    (tmp_path / "out.jsonl").unlink(missing_ok=True)
    assert cli.main(command(name, str(good), tmp_path)) == 0
    assert torch.get_num_threads() == cli.DEFAULT_THREADS == 1
    capsys.readouterr()


@pytest.mark.parametrize("name", ["generate", "batch"])
@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "100000"])  # (10**5: a traceback, out of memory loading)
def test_threads_must_be_a_positive_integer_up_to_the_cpus(name, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command(name, str(tmp_path / "nowhere"), tmp_path), "--threads", value])
    assert exit_.value.code == 2
    line = one_error_line(capsys, name)
    assert "--threads" in line and value in line
    if value == "100000":
        assert f"100000 is outside [1, {os.cpu_count()}] (this machine's CPUs)" in line, line


# --- generate --compare ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pipeline", "block", "auto"])
def test_compare_prints_both_timings_the_ratio_and_that_the_tokens_are_identical(mode, good, tmp_path, capsys):
    argv = ["generate", "w5 w6 w7", "--model", str(good), "--device", "cpu", "--max-new-tokens", "8", "--mode", mode]
    assert cli.main([*argv, "--compare"]) == 0
    err = capsys.readouterr().err
    assert f"\n[{mode}] 8 new tokens in " in err and "\n[plain] 8 new tokens in " in err
    assert f"\nspeed {mode} / plain: " in err
    assert "\ntokens identical to plain decoding: yes (8 new tokens)\n" in err


def test_compare_with_auto_calibrates_before_the_timed_runs(good, capsys, monkeypatch):
    """With auto, the cost table exists before either timed run starts (so the ratio compares decoding with
    decoding), an untimed plain warm-up call runs before both, and the table's time is printed on its own line
    before the runs' lines."""
    timed, warm, tables = cli._timed_generate, cli._warm_up, []

    def checking(model, enc, kwargs, seed):
        tables.append(kept_table(model, 1))
        return timed(model, enc, kwargs, seed)

    def warming(model, enc, kwargs):
        tables.append("warm-up")
        return warm(model, enc, kwargs)

    monkeypatch.setattr(cli, "_timed_generate", checking)
    monkeypatch.setattr(cli, "_warm_up", warming)
    argv = ["generate", "w5 w6 w7", "--model", str(good), "--device", "cpu", "--max-new-tokens", "8", "--compare",
            "--mode", "auto"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert len(tables) == 3 and tables[0] == "warm-up" and tables[1] is not None
    ready = re.search(r"(^|\n)\[auto\] cost table ready in \d+\.\d\d s \(measured once per model", err)
    assert ready and ready.start() < err.index("\n[auto] 8 new tokens in ") < err.index("\n[plain] 8 new tokens in ")


def test_compare_reports_differing_tokens_and_fails(good, tmp_path, capsys, monkeypatch):
    """A speculative run whose 4th new token differs from plain decoding's (forced: the plain run's output is
    changed) is reported with the position and exit status 1, since greedy float32 tokens must be identical."""
    timed = cli._timed_generate

    def plain_changed(model, enc, kwargs, seed):
        out, seconds = timed(model, enc, kwargs, seed)
        if kwargs["speculative_mode"] is None:
            out.sequences = out.sequences.clone()  # generate's tensors are inference tensors
            out.sequences[0, enc["input_ids"].shape[-1] + 3] += 1
        return out, seconds

    monkeypatch.setattr(cli, "_timed_generate", plain_changed)
    argv = ["generate", "w5 w6 w7", "--model", str(good), "--device", "cpu", "--max-new-tokens", "8", "--compare"]
    assert cli.main(argv) == 1
    assert "\ntokens identical to plain decoding: no, they differ from new token 3 on\n" in capsys.readouterr().err


def test_compare_with_sampling_says_the_tokens_are_not_compared(good, capsys):
    argv = ["generate", "w5 w6", "--model", str(good), "--device", "cpu", "--max-new-tokens", "4", "--compare",
            "--do-sample", "--seed", "0"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "\n[plain] 4 new tokens in " in err and "\ntokens: not compared (sampled runs differ by design" in err


# --- option combinations refused before anything loads ------------------------------------------------------------


REFUSED = [  # (options, what the one line must contain)
    (["--temperature", "0.7"], "without --do-sample, which greedy decoding ignores: --temperature 0.7;"),
    (["--top-p", "0.9", "--top-k", "5"], "greedy decoding ignores: --top-p 0.9, --top-k 5;"),
    (["--mode", "plain", "--draft-loops", "2"], "with --mode plain, which decodes without them: --draft-loops 2;"),
    (["--num-speculative-tokens", "3", "--mode", "plain"], "decodes without them: --num-speculative-tokens 3;"),
    # the default value, given explicitly
    (["--mode", "plain", "--draft-loops", "1"], "decodes without them: --draft-loops 1;"),
    # block mode's drafts per round: pipeline never reads it (it ran, and K had no effect)
    (["--mode", "pipeline", "--num-speculative-tokens", "16"], "--num-speculative-tokens 16 with --mode pipeline"),
]


@pytest.mark.parametrize("name", ["generate", "batch"])
@pytest.mark.parametrize(("options", "message"), REFUSED)
def test_options_that_would_be_ignored_are_refused_up_front(name, options, message, tmp_path, capsys):
    nowhere = str(tmp_path / "nowhere")  # checked before the model: the error is about the options, not the folder
    assert cli.main([*command(name, nowhere, tmp_path), *options]) == 2
    line = one_error_line(capsys, name)
    assert message in line
    fix = "--do-sample" if "greedy decoding ignores" in message else (
        "pass --mode block" if "--mode pipeline" in message else "--mode block or --mode pipeline")
    assert fix in line


def test_compare_with_plain_mode_is_refused(tmp_path, capsys):
    assert cli.main([*command("generate", str(tmp_path / "nowhere"), tmp_path), "--mode", "plain", "--compare"]) == 2
    assert "--compare decodes PROMPT plainly next to a speculative mode" in one_error_line(capsys, "generate")


@pytest.mark.parametrize("name", ["generate", "batch"])
def test_sampling_and_speculative_options_are_accepted_where_they_apply(name, good, tmp_path, capsys):
    options = ["--do-sample", "--temperature", "0.7", "--top-k", "5", "--mode", "block", "--draft-loops", "1",
               "--num-speculative-tokens", "2", "--seed", "0"]
    assert cli.main([*command(name, str(good), tmp_path), *options]) == 0
    capsys.readouterr()


def test_top_k_0_turns_the_top_k_filter_off(good):
    """`--top-k 0` is accepted (it was refused as "must be >= 1") and passed as top_k=0, which builds no top-k warper,
    where an unset --top-k leaves transformers' default top-k filter in place, as `bench --top-k 0` does."""
    model = AutoModelForCausalLM.from_pretrained(good)

    def warpers(*options):
        args = cli.build_parser().parse_args(["generate", "x", "--do-sample", *options])
        kwargs = generate_kwargs(args, model, tokenizer=None)
        config, _ = model._prepare_generation_config(None, **kwargs)
        processors = model._get_logits_processor(config, input_ids_seq_length=1, encoder_input_ids=None,
                                                 prefix_allowed_tokens_fn=None, logits_processor=None)
        return kwargs.get("top_k"), [type(p) for p in processors]

    assert warpers("--top-k", "0") == (0, [])
    top_k, default = warpers()
    assert top_k is None and TopKLogitsWarper in default


@pytest.mark.parametrize("mode", ["plain", "pipeline"])
@pytest.mark.parametrize("name", ["generate", "batch"])
def test_a_checkpoints_stop_strings_stop_the_cli(name, mode, tmp_path, capsys):
    """A checkpoint whose generation_config.json saves a stop string (the embedded model's byte-level tokenizer: a
    word-level one has no byte offsets to match with): `generate` and `batch` pass the tokenizer that transformers
    matches it with, and stop early at it (both failed in every mode with transformers' error asking for a
    `tokenizer` argument, which the CLI has not)."""
    def text(model: str, *options: str) -> str:
        (tmp_path / "out.jsonl").unlink(missing_ok=True)
        assert cli.main([*command(name, model, tmp_path), "--max-new-tokens", "12", *options]) == 0
        out = capsys.readouterr().out.rstrip("\n")
        return out if name == "generate" else json.loads((tmp_path / "out.jsonl").read_text())["completion"]

    plain = text("default", "--mode", "plain")
    stop = plain[len(plain) // 3:][:3]
    folder = tmp_path / "stops"
    shutil.copytree(default_model_path(), folder)
    saved = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**saved, "stop_strings": [stop]}))
    stopped = text(str(folder), "--mode", mode)
    assert stop in stopped and plain.startswith(stopped) and len(stopped) < len(plain)


def test_generate_prints_the_completion_and_one_newline(good, tmp_path, capsys):
    """`generate`'s stdout is the text `batch` writes as the completion of the same prompt, then one newline (the
    streamer's end prints it; a second print left a blank line)."""
    assert cli.main(command("batch", str(good), tmp_path)) == 0
    completion = json.loads((tmp_path / "out.jsonl").read_text())["completion"]
    capsys.readouterr()
    assert cli.main(command("generate", str(good), tmp_path)) == 0
    assert capsys.readouterr().out == completion + "\n" and completion.strip()


def test_text_that_stdout_cannot_encode_is_one_line_with_the_fix(good, tmp_path, capsys, monkeypatch):
    """A stdout whose encoding cannot hold the generated text (PYTHONIOENCODING=ascii, a cp1252 console): the one
    error line names the encoding and the fix, not only the codec's complaint."""
    folder = tmp_path / "accents"
    shutil.copytree(good, folder)
    word_tokenizer(letter="\u00e9").save_pretrained(folder)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert cli.main(["generate", "\u00e95 \u00e96", "--model", str(folder), "--device", "cpu",
                     "--max-new-tokens", "2", "--mode", "plain"]) == 2
    line = capsys.readouterr().err.splitlines()[-1]  # (after the weights' progress bar)
    assert line.startswith("hf-loopspec generate: error: 'ascii' codec can't encode") and line.endswith(
        "stdout's encoding (ascii) cannot hold the text: set PYTHONIOENCODING=utf-8")


@pytest.mark.parametrize("pad", [0, 5])  # the checkpoint's own (EOS, "<|endoftext|>"), and one that is text ("&")
@pytest.mark.parametrize("mode", ["plain", "pipeline"])
def test_batch_rows_end_where_a_saved_stop_string_ends_them(mode, pad, tmp_path):
    """`batch` on prompts of three lengths (one left-padded batch) with saved stop strings, one of which ends the
    first row early and one of which would end in the pad text before the shortest prompt: each row is what plain
    `generate` returns for its prompt alone with those stop strings and the tokenizer, and says how it ended. A row
    that stopped first was read on into the pad that `generate` fills it with (a pad id equal to EOS made it "eos"
    with one token too many, another decoded the pad as text), a row that stopped at a stop string said "length",
    and the shortest row ended at once, its stop string matched across its padding."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    texts, limit = ["def add(a, b):", "The quick brown fox jumps", "x"], 16
    alone = model.generate(**tokenizer(texts[0], return_tensors="pt"), max_new_tokens=2, do_sample=False,
                           speculative_mode=None)[0, len(tokenizer(texts[0]).input_ids):]
    stops = [tokenizer.decode(alone)[-2:], tokenizer.decode([pad])[-1:] + "xx"]  # (the second: across the padding)
    folder = tmp_path / "stops"
    shutil.copytree(default_model_path(), folder)
    saved = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**saved, "stop_strings": stops, "pad_token_id": pad}))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n"
                                                    for i, t in enumerate(texts)))
    assert cli.main(["batch", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--model",
                     str(folder), "--device", "cpu", "--mode", mode, "--max-new-tokens", str(limit),
                     "--batch-size", "3"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    eos = model.generation_config.eos_token_id
    for row, text in zip(rows, texts):
        prompt = tokenizer(text).input_ids
        new = model.generate(torch.tensor([prompt]), max_new_tokens=limit, do_sample=False, speculative_mode=None,
                             stop_strings=stops, tokenizer=tokenizer)[0, len(prompt):].tolist()
        assert eos not in new  # (these prompts' answers have no EOS within the limit: checked here)
        assert row["completion"] == tokenizer.decode(new, skip_special_tokens=True)
        assert row["new_tokens"] == len(new)
        assert row["stop"] == ("stop_string" if any(stop in tokenizer.decode(new) for stop in stops) else "length")
    assert rows[0]["stop"] == "stop_string" and rows[0]["new_tokens"] == 2
    assert rows[2]["new_tokens"] > 1  # (the shortest prompt's first token was judged with its padding before it)


@pytest.mark.parametrize("saved, problem", [(["w65"], "its tokenizer (TokenizersBackend) cannot match"),
                                            ([5], "is not a non-empty string"), ([""], "is not a non-empty string"),
                                            ([], "is not a non-empty string")])
def test_saved_stop_strings_generate_cannot_use_are_named_before_anything_runs(tmp_path, capsys, saved, problem):
    """A checkpoint whose generation_config.json saves stop strings that its tokenizer cannot match (a word-level
    one: no byte-level vocabulary, which transformers' stop-string criterion needs) or that `generate` refuses:
    `generate` and `batch` end with one line naming the file and the fix, `batch` before it makes OUT.parts (they
    ended with transformers' bare "substring not found", an AttributeError traceback for [5], or `generate`'s advice
    to pass tokenizer=... with OUT.parts left behind)."""
    good = save_checkpoint(tmp_path / "ckpt", seed=1, max_position_embeddings=64)
    settings = json.loads((good / "generation_config.json").read_text())
    (good / "generation_config.json").write_text(json.dumps({**settings, "stop_strings": saved}))
    capsys.readouterr()
    for name in ("generate", "batch"):
        assert cli.main(command(name, str(good), tmp_path)) == 2
        out, err = capsys.readouterr()  # (after transformers' bar of the weights it loaded)
        line = err.splitlines()[-1]
        assert out == "" and line.startswith(f"hf-loopspec {name}: error: the checkpoint's generation_config.json "
                                             f"sets stop_strings={saved!r}, which {problem}"), line
    assert not (tmp_path / "out.jsonl.parts").exists()


# --- models that are not looped, text that is not UTF-8, lm-eval's folders --------------------------------------


@pytest.mark.parametrize("name", ["generate", "batch", "bench", "export"])
def test_a_folder_of_another_model_type_is_refused_before_its_weights_load(name, good, tmp_path, capsys):
    """An Ouro folder whose config.json is a gpt2 config (written by transformers' GPT2Config): one line naming the
    file and the type, and no weights-loading progress line before it (it is refused before the weights load)."""
    folder = tmp_path / "gpt2"
    shutil.copytree(good, folder)
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(folder)
    assert cli.main(command(name, str(folder), tmp_path)) == 2
    line = one_error_line(capsys, name)
    assert f"{folder / 'config.json'} has model_type 'gpt2', which is not a looped model" in line
    assert not (tmp_path / "OUT").exists()


def test_a_config_that_is_not_json_is_named(good, tmp_path, capsys):
    folder = tmp_path / "bad-config"
    shutil.copytree(good, folder)
    (folder / "config.json").write_text("{not json")
    assert cli.main(command("generate", str(folder), tmp_path)) == 2
    assert f"{folder / 'config.json'} is not a valid config.json" in one_error_line(capsys, "generate")


@pytest.mark.parametrize(("prompt", "what"), [("ab\udcffc", "byte 0xff at character 2"),
                                              ("\ud800x", "lone surrogate U+D800 at character 0")])
def test_a_prompt_that_is_not_utf8_is_one_line(prompt, what, good, tmp_path, capsys):
    """"ab\\udcffc" is what `sys.argv` holds for the bytes b"ab\\xffc" (Python decodes arguments with
    surrogateescape); the check runs before the model loads."""
    argv = ["generate", prompt, "--model", str(good), "--device", "cpu"]
    assert cli.main(argv) == 2
    assert f"PROMPT is not UTF-8 text ({what})" in one_error_line(capsys, "generate")


@pytest.mark.parametrize("spec", ["./nope", "{tmp}/no/such/folder", "~/no-such-folder-here"])
@pytest.mark.parametrize("form", ["separate", "joined"])
def test_lm_eval_with_a_missing_local_folder_says_so(spec, form, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = spec.format(tmp=tmp_path)
    model_args = f"pretrained={spec},dtype=float32"
    given = ["--model_args", model_args] if form == "separate" else [f"--model_args={model_args}"]
    assert cli.main(["lm-eval", "run", "--model", "hf", *given, "--tasks", "x"]) == 2
    line = one_error_line(capsys, "lm-eval")
    assert f"--model_args pretrained={spec}: no such folder: {spec}" in line and "Repo id" not in line


def test_the_tokenizers_length_warning_does_not_precede_the_error(tmp_path, capsys, monkeypatch):
    """A tokenizer whose model_max_length is the model's positions warns, when asked to encode a longer text, that
    indexing errors will follow; the CLI turns that case into its own error line, so the warning is not printed.
    transformers' log handler (a plain StreamHandler) keeps the stream it was made with; it is pointed at the
    captured stderr here. pytest may add its own handlers to that logger (subclasses, left alone)."""
    for handler in logging.getLogger("transformers").handlers:
        if type(handler) is logging.StreamHandler:
            monkeypatch.setattr(handler, "stream", sys.stderr)
    folder = save_checkpoint(tmp_path / "ckpt", seed=1, tokenizer=False, max_position_embeddings=POSITIONS)
    tokenizer = word_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer.model_max_length = POSITIONS
    tokenizer.save_pretrained(folder)
    long_prompt = " ".join(["w5"] * (POSITIONS + 2))
    assert len(tokenizer(long_prompt)["input_ids"]) > POSITIONS  # (the warning the CLI must not print, once here)
    assert "Token indices sequence length is longer" in capsys.readouterr().err
    for chat in ([], ["--chat"]):
        assert cli.main(["generate", long_prompt, "--model", str(folder), "--device", "cpu", *chat]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert all("Loading weights" in line for line in lines[:-1]), lines
        assert lines[-1].startswith("hf-loopspec generate: error: the prompt is ")


@pytest.mark.parametrize("template, error", [("{{ raise_exception('System role not supported') }}", "TemplateError"),
                                             ("{% for m in messages %}{{ m['content'] }}", "TemplateSyntaxError"),
                                             ("{{ messages[0]['content'] + 1 }}", "TypeError"),
                                             ("{{ 1 / 0 }}", "ZeroDivisionError")])
def test_a_chat_template_that_fails_is_one_line(template, error, tmp_path, capsys):
    """A chat template that raises (as many Hub templates do for a role they refuse, or with a Python error of its
    expressions) or does not parse: one line naming --chat, the template's error and the fix, for generate and batch
    (a traceback before)."""
    folder = save_checkpoint(tmp_path / "ckpt", seed=1, tokenizer=False, max_position_embeddings=POSITIONS)
    word_tokenizer(chat_template=template).save_pretrained(folder)
    capsys.readouterr()  # (the save's progress bar)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "prompt": "w5"}\n')
    for argv in (["generate", "w5"], ["batch", str(prompts), "--output", str(tmp_path / "out.jsonl")]):
        assert cli.main([*argv, "--model", str(folder), "--device", "cpu", "--chat"]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]  # (after the weights' progress bar)
        assert last.startswith(f"hf-loopspec {argv[0]}: error: --chat: the chat template of {folder} fails on one "
                               f"user message ({error}: "), last


def test_a_folder_without_a_tokenizer_is_refused_before_its_weights_load(tmp_path, capsys, monkeypatch):
    """generate, batch and serve need the tokenizer: a folder without tokenizer files is named as such before any
    weight loads (generate loaded the model first; serve said to install a tokenizer library)."""
    folder = save_checkpoint(tmp_path / "ckpt", seed=1, tokenizer=False)
    capsys.readouterr()
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: pytest.fail("weights loaded"))
    assert cli.main(["generate", "w5", "--model", str(folder), "--device", "cpu"]) == 2
    assert f"{folder} has no tokenizer files (tokenizer.json, tokenizer_config.json); add them" in \
        one_error_line(capsys, "generate")
    with pytest.raises(ValueError, match=f"{folder} has no tokenizer files"):
        serving.chat_template_note(str(folder))


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", "4096", "OuroConfig.vocab_size='4096' is invalid: it must be a positive integer."),
    ("dtype", "float13", "OuroConfig.dtype='float13' is no torch dtype"),
])
def test_a_config_field_the_family_refuses_is_one_line(field, value, message, tmp_path, capsys):
    """A config.json field of the wrong type or a dtype torch lacks: the family's ValueError naming the field, in one
    line (the tokenizer read config.json with transformers' base class first: a StrictDataclassClassValidationError
    or torch's AttributeError, with a traceback), for generate and serve."""
    folder = save_checkpoint(tmp_path / "ckpt", seed=1)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    capsys.readouterr()
    assert cli.main(["generate", "w5", "--model", str(folder), "--device", "cpu"]) == 2
    assert message in one_error_line(capsys, "generate")
    with pytest.raises(ValueError, match=re.escape(message)):
        serving.chat_template_note(str(folder))


# --- the console script ---------------------------------------------------------------------------------------------


def launch(*argv: str) -> subprocess.CompletedProcess:
    """The console script's entry point (`hf_loopspec_cli.main`, what `hf-loopspec` runs) in a fresh interpreter;
    prints which of torch and transformers it imported."""
    code = ("import sys, hf_loopspec_cli\n"
            f"sys.argv = ['hf-loopspec', *{list(argv)!r}]\n"
            "try:\n    status = hf_loopspec_cli.main()\nexcept SystemExit as stop:\n    status = stop.code\n"
            "print('imported:', [m for m in ('torch', 'transformers') if m in sys.modules])\n"
            "sys.exit(status)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          cwd=ROOT, timeout=300, check=False)


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["export", "--help"],
                                  ["batch", "--help"], ["generate"], ["bench", "--batch-size", "0"],
                                  ["generate", "x", "--max-new-tokens", "abc"], ["export", "--bogus"],
                                  ["bench", "--modes", "foo"]],
                         ids=["help", "generate-help", "bench-help", "export-help", "batch-help", "missing-prompt",
                              "bad-value", "not-a-number", "unknown-option", "mode-not-offered"])
def test_help_and_argument_errors_load_neither_torch_nor_transformers(argv):
    result = launch(*argv)
    if "--help" in argv:
        assert result.returncode == 0 and result.stdout.startswith("usage: hf-loopspec"), result.stderr
    else:  # the one-line argument error
        assert result.returncode == 2 and result.stderr.startswith("hf-loopspec") and " error: " in result.stderr
    assert result.stdout.rstrip().endswith("imported: []"), result.stdout[-300:]


@pytest.mark.parametrize("argv, flag", [
    (["generate", "x", "--temperature", "0.5"], "--temperature"),
    (["batch", "in.jsonl", "--output", "out.jsonl", "--mode", "plain", "--draft-loops", "2"], "--draft-loops"),
])
def test_refused_options_answer_before_torch_loads(argv, flag):
    """docs/cli.md: options the chosen decoding would ignore are refused without loading torch (they loaded torch
    and transformers first, several seconds)."""
    result = launch(*argv)
    assert result.returncode == 2 and result.stderr.startswith(f"hf-loopspec {argv[0]}: error: ")
    assert flag in result.stderr
    assert result.stdout.rstrip().endswith("imported: []"), result.stdout[-300:]


def test_console_script_registers_before_a_command():
    """The deferred registration happens before the command: the embedded model loads through the Auto classes."""
    result = launch("generate", "def f(x):", "--mode", "plain", "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert "[plain] 4 new tokens" in result.stderr


def test_draft_depths_are_checked_against_the_steps_the_checkpoint_runs(tmp_path, capsys):
    """A Huginn checkpoint whose generation config sets num_steps runs that many loops: its depths are checked
    against them before anything decodes (checked against mean_recurrence, 4 here: a depth of 6 with 8 steps was
    refused, and one of 3 with 2 steps failed in batch's first batch, leaving an OUT.parts behind)."""
    from huginn_utils import tiny_huginn

    for steps in (8, 2):
        model, _ = tiny_huginn(seed=0)
        assert model.config.mean_recurrence == 4
        model.generation_config.num_steps = steps
        model.save_pretrained(tmp_path / f"huginn{steps}")
        word_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / f"huginn{steps}")
    assert cli.main(["generate", "w5 w9 w11", "--model", str(tmp_path / "huginn8"), "--mode", "block",
                     "--draft-loops", "6", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "w5 w9"}\n')
    output = tmp_path / "out.jsonl"
    assert cli.main(["batch", str(tmp_path / "in.jsonl"), "--output", str(output), "--model",
                     str(tmp_path / "huginn2"), "--mode", "block", "--draft-loops", "3", "--max-new-tokens", "4"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (after the weights' loading bar)
    assert last.startswith("hf-loopspec batch: error: --draft-loops=3 is outside [1, 1] for a model with 2 loops")
    assert not output.exists() and not (tmp_path / "out.jsonl.parts").exists()


def test_greedy_huginn_runs_start_from_the_same_initial_states(tmp_path, capsys):
    """A Huginn checkpoint draws random initial states (init_scale 1 by default): greedy `generate` without --seed
    keys them with init_seed 0, so that --compare's plain run sees the speculative run's states (it reported
    "tokens differ" and exit 1 for a kept guarantee) and two runs, or a resumed batch, print the same tokens."""
    from huginn_utils import tiny_huginn

    model, _ = tiny_huginn(seed=0)
    model.save_pretrained(tmp_path / "huginn")
    word_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "huginn")
    argv = ["generate", "w5 w9 w11", "--model", str(tmp_path / "huginn"), "--mode", "pipeline",
            "--max-new-tokens", "8"]
    assert cli.main([*argv, "--compare"]) == 0
    assert "tokens identical to plain decoding: yes" in capsys.readouterr().err
    printed = []
    for _ in range(2):
        assert cli.main(argv) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and printed[0].strip()


def test_sampling_options_at_their_off_values_are_not_passed_to_greedy_decoding():
    """`--top-k 0` (or `--temperature 1.0`, `--top-p 1.0`) without `--do-sample` is accepted as "off", and was passed
    on to the greedy call, where transformers warned that the flag is not valid and may be ignored."""
    model = AutoModelForCausalLM.from_pretrained(default_model_path())
    off = dict(max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=None, mode="plain", seed=None)
    greedy = generate_kwargs(argparse.Namespace(do_sample=False, **off), model, tokenizer=None)
    assert not {"temperature", "top_k", "top_p"} & set(greedy)
    sampled = generate_kwargs(argparse.Namespace(do_sample=True, **off), model, tokenizer=None)
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"]) == (1.0, 0, 1.0)
