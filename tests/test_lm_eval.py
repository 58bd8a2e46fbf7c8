"""`hf-loopspec lm-eval` runs lm-evaluation-harness's own CLI (its `hf` backend, `model.generate` in batches with
its stop-sequence criterion and a `max_length`) on the embedded model offline, over a tiny local generate_until
task written here; the outputs it logs with speculative `--gen_kwargs` equal plain decoding's at the same batch
size."""

from __future__ import annotations

import gc
import json
import shutil
import sys

import pytest
import torch
from checkpoint_utils import word_tokenizer
from huginn_utils import tiny_huginn
from tolerances import fp32_tolerance, huginn_depth

from hf_loopspec import cli, evaluation
from hf_loopspec.assets import default_model_path

TASK = "loopspec_tiny"
PROMPTS = ["def add(a, b):\n", "import os\n\n", "class Point:\n", "for i in range(3):\n", "x = [1, 2, 3]\n",
           "def main():\n", "if x is None:\n", "try:\n"]
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: OUTPUT_TYPE
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
"""  # a local task of `data`'s rows (prompt, target); OUTPUT_TYPE and the rest are the task kind's
YAML = TASK_YAML.replace("OUTPUT_TYPE", "generate_until") + """\
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The task folder (YAML + JSONL); offline: no Hub, datasets' cache in a temporary folder. lm-eval's task
    manager indexes only this folder (`include_defaults=False`), not the thousands of task files lm-eval ships (which
    every run would parse again, most of a run's time); the run, its `hf` backend and its stop sequences are lm-eval's
    own."""
    folder = tmp_path_factory.mktemp("lm_eval_task")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "target": "pass"}) + "\n" for p in PROMPTS), encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=data), encoding="utf-8")
    from lm_eval import tasks  # the test extra installs lm-eval

    class OwnTasksOnly(tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{"include_defaults": False} | kwargs)

    with pytest.MonkeyPatch.context() as env:
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            env.setenv(key, "1")
        env.setenv("HF_DATASETS_CACHE", str(folder / "datasets_cache"))
        env.setattr(tasks, "TaskManager", OwnTasksOnly)
        yield folder


@pytest.fixture(scope="module")
def logged(task_dir):
    """`logged(batch_size, gen_kwargs)`: the responses lm-eval logs per doc_id (each run once)."""
    runs = {}

    def run(batch_size: int, gen_kwargs: str) -> dict[int, list]:
        if (batch_size, gen_kwargs) not in runs:
            out = task_dir / f"out-{batch_size}-{len(runs)}"
            code = cli.main(["lm-eval", "run", "--model", "hf", "--model_args",
                             f"pretrained={default_model_path()},dtype=float32", "--tasks", TASK, "--include_path",
                             str(task_dir), "--batch_size", str(batch_size), "--device", "cpu", "--log_samples",
                             "--output_path", str(out), "--gen_kwargs", gen_kwargs])
            assert code == 0
            (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
            rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
            assert sorted(row["doc_id"] for row in rows) == list(range(len(PROMPTS)))
            runs[batch_size, gen_kwargs] = {row["doc_id"]: row for row in rows}
        return runs[batch_size, gen_kwargs]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])  # 4: lm-eval's stop-sequence criterion sees the whole batch
def test_speculative_gen_kwargs_log_plain_outputs(logged, batch_size):
    # the embedded model's generation_config.json defaults to auto, so plain is asked for explicitly
    plain = logged(batch_size, "speculative_mode=None")
    # on the wavefront engine (it would raise rather than fall back): lm-eval's `until` strings are stop strings
    spec = logged(batch_size, "speculative_mode=pipeline,draft_loops=1,speculative_engine=wavefront")
    default = logged(batch_size, "do_sample=False")  # the generation config's mode: auto
    for doc_id, row in spec.items():
        assert row["arguments"]["gen_args_0"]["arg_1"]["speculative_mode"] == "pipeline"
        assert plain[doc_id]["arguments"]["gen_args_0"]["arg_1"]["speculative_mode"] is None
        assert "speculative_mode" not in default[doc_id]["arguments"]["gen_args_0"]["arg_1"]
        assert row["resps"] == plain[doc_id]["resps"] == default[doc_id]["resps"], (doc_id, row["doc"])
    assert any(row["resps"][0][0].strip() for row in plain.values())  # something was generated


LL_YAML = TASK_YAML.replace("OUTPUT_TYPE", "loglikelihood") + """\
metric_list:
  - metric: acc
"""


def test_huginn_scores_under_the_model_args_recurrence_settings(task_dir, tmp_path):
    """Huginn's `num_steps` / `init_scale` in `--model_args` reach scoring too (loglikelihood ran the model's
    defaults, random initial states drawn per call, and `--model_args num_steps=...` was refused): each logged
    loglikelihood equals a log-softmax sum of one forward at those settings, at batch size 1 and 3 alike, and so does
    lm-eval's `HFLM` given them from Python (which scored at the model's defaults while the CLI did not)."""
    model, _ = tiny_huginn(seed=0)
    folder = tmp_path / "huginn"
    model.save_pretrained(folder)
    tokenizer = word_tokenizer(model.config.vocab_size)
    tokenizer.save_pretrained(folder)
    rows = [{"prompt": f"w{3 + i} w{40 + i} w{70 - i} w{9 + i}", "target": f" w{20 + i} w{60 - i}"} for i in range(3)]
    data = task_dir / "huginn_ll.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (task_dir / "huginn_ll.yaml").write_text(LL_YAML.format(task="huginn_ll", data=data), encoding="utf-8")
    settings = {"num_steps": 3, "init_scale": 0.0}  # not the config's mean_recurrence, nor its random states

    def expected(row):
        context, target = tokenizer(row["prompt"]).input_ids, tokenizer(row["target"]).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([context + target[:-1]]), **settings).logits[0]
        scores = torch.log_softmax(logits, -1)[len(context) - 1:]
        return float(scores[torch.arange(len(target)), torch.tensor(target)].sum())

    assert settings["num_steps"] != model.config.mean_recurrence
    for batch_size in (1, 3):
        out = tmp_path / f"out-{batch_size}"
        code = cli.main(["lm-eval", "run", "--model", "hf", "--model_args",
                         f"pretrained={folder},dtype=float32,num_steps=3,init_scale=0.0", "--tasks", "huginn_ll",
                         "--include_path", str(task_dir), "--batch_size", str(batch_size), "--device", "cpu",
                         "--log_samples", "--output_path", str(out)])
        assert code == 0
        (samples,) = out.rglob("samples_huginn_ll_*.jsonl")
        logged = {row["doc_id"]: row for row in map(json.loads, samples.read_text(encoding="utf-8").splitlines())}
        for doc_id, row in enumerate(rows):
            # the same forward in another batch (padding): rounding of its depth, on the sum's scale (`tolerances`)
            want = expected(row)
            bound = fp32_tolerance(**huginn_depth(model.config, 3), scale=abs(want))["atol"]
            assert float(logged[doc_id]["resps"][0][0][0]) == pytest.approx(want, abs=bound), doc_id
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=3, **settings)
    requests = [Instance(request_type="loglikelihood", doc=row, arguments=(row["prompt"], row["target"]), idx=0,
                         metadata=("huginn_ll", doc_id, 1)) for doc_id, row in enumerate(rows)]
    for (score, _), row in zip(lm.loglikelihood(requests), rows, strict=True):
        want = expected(row)
        bound = fp32_tolerance(**huginn_depth(model.config, 3), scale=abs(want))["atol"]
        assert score == pytest.approx(want, abs=bound), row


def test_without_lm_eval_installed_the_error_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # what an install without the extra looks like
    assert cli.main(["lm-eval", "run", "--tasks", TASK]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hf-loopspec lm-eval: error: lm-eval is not installed")
    assert 'pip install "hf-loopspec[eval] @ git+' in err  # the extra, from the repository (not on PyPI)


@pytest.mark.parametrize("model_args, named", [
    (",bogus_arg=3", "bogus_arg"),  # lm-eval hands it to from_pretrained: the model's __init__ raised a TypeError
    (",dtype=float99", "dtype=float99"),  # lm-eval's getattr(torch, ...) raised an AttributeError
    (",max_length=abc", "max_length=abc: pass a whole number"),  # a TypeError once lm-eval ran its requests
    (",max_batch_size=0", "max_batch_size=0"),
    (",speculative_mode=pipeline", "speculative_mode='pipeline': decoding settings"),  # refused by from_pretrained
    (",temperature=0.5,top_k=3", "temperature=0.5, top_k=3: decoding settings"),
])
def test_bad_model_args_end_in_one_line(task_dir, capsys, model_args, named):
    """docs/cli.md: every error a user can cause ends in one line and exit status 2 (these were tracebacks, 1). A
    decoding setting is refused by the model's `from_pretrained` (as under lm-eval's own command), naming
    --gen_kwargs."""
    code = cli.main(["lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={default_model_path()}"
                     f"{model_args}", "--tasks", TASK, "--include_path", str(task_dir), "--device", "cpu",
                     "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and named in err[-1]
    assert err[-1].startswith("hf-loopspec lm-eval: error: " + ("" if "decoding" in named else "--model_args"))
    assert "decoding" not in named or "--gen_kwargs" in err[-1]


def test_a_device_this_machine_lacks_ends_in_one_line(task_dir, capsys, monkeypatch):
    """`--device cuda` without CUDA: `generate`'s one line and status 2 (lm-eval's torch traceback, status 1)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = cli.main(["lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={default_model_path()}",
                     "--tasks", TASK, "--include_path", str(task_dir), "--device", "cuda", "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == ("hf-loopspec lm-eval: error: --device cuda was requested but CUDA is not "
                                     "available here; use --device cpu.")


def test_several_processes_without_gpus_to_split_over_end_in_one_line(task_dir, capsys, monkeypatch):
    """Under `accelerate launch --num_processes 2` on a CPU, lm-eval's `hf` backend does not split the documents
    (only over two or more GPUs): each process evaluated every document, twice the work and no word."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = cli.main(["lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={default_model_path()}",
                     "--tasks", TASK, "--include_path", str(task_dir), "--device", "cpu", "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("hf-loopspec lm-eval: error: hf-loopspec lm-eval runs in 2 processes")
    assert "every process would evaluate every document" in err[-1]


def test_a_home_relative_folder_is_expanded_before_lm_eval_sees_it(monkeypatch, tmp_path):
    """`pretrained=~/model` (quoted, or from Python) names the folder under the home directory; lm-eval would take
    the unexpanded text for a Hub repo id. Every form lm-eval takes is read as lm-eval reads it (its own parsing),
    and merged into one JSON `--model_args`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    forms = [["--model_args", "pretrained=~/model,dtype=float32"], ["--model_args=pretrained=~/model"],
             ["-a", "pretrained=~/model", "dtype=float32"], ["--model_args", '{"pretrained": "~/model"}'],
             ["-a", "dtype=float32", "--model_args", "pretrained=~/model,max_length=None"],
             ["--model_args", 'pretrained="~/model"']]  # lm-eval takes the quotes off
    for form in forms:
        checked = evaluation.check_model_args(["run", "--tasks", "x", *form, "--limit", "1"])
        assert checked[:5] == ["run", "--tasks", "x", "--limit", "1"] and checked[5] == "--model_args"
        assert json.loads(checked[6])["pretrained"] == str(tmp_path / "model"), form
    with pytest.raises(FileNotFoundError, match="pretrained=~/nope: no such folder: ~/nope"):  # named as given
        evaluation.check_model_args(["--model_args", "pretrained=~/nope"])
    for form in (["-a", "pretrained=~/model", "max_length=0"], ["--model_args", '{"max_length": "abc"}']):
        with pytest.raises(ValueError, match="max_length=.*: pass a whole number >= 1"):
            evaluation.check_model_args(form)
    assert evaluation.check_model_args(["run", "--tasks", "x"]) == ["run", "--tasks", "x"]  # nothing to merge
    # the embedded model by the name the other commands take (lm-eval tried the Hub repo "default")
    checked = evaluation.check_model_args(["-a", "pretrained=default,tokenizer=default"])
    assert json.loads(checked[1]) == {"pretrained": str(default_model_path()), "tokenizer": str(default_model_path())}
    evaluation.check_device(["--device", "auto"])  # lm-eval's to read (it picks cuda when there is one, else cpu)


def test_a_hub_id_not_in_the_cache_while_offline_is_named_so(monkeypatch, capsys):
    """lm-eval's own error named neither the id, --model_args nor HF_HUB_OFFLINE ("We couldn't connect ...")."""
    import huggingface_hub.constants
    import lm_eval.__main__

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval ran"))
    code = cli.main(["lm-eval", "run", "--model", "hf", "--tasks", TASK, "--model_args", "pretrained=someone/nowhere"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["hf-loopspec lm-eval: error: --model_args pretrained=someone/nowhere: someone/nowhere "
                                 "is not a local folder, and it is not in the local Hub cache while the Hub is off "
                                 "(HF_HUB_OFFLINE=1); pass a checkpoint folder or 'default', or unset HF_HUB_OFFLINE "
                                 "to download it."]


def test_a_hub_id_cached_at_the_revision_asked_for_passes_offline(monkeypatch, tmp_path):
    """`--model_args pretrained=ID,revision=TAG` with only TAG cached (what `hf download ID --revision TAG` leaves):
    the cache check looked at main, refusing what transformers loads offline."""
    import huggingface_hub.constants
    import lm_eval.__main__

    repo = tmp_path / "hub" / "models--someone--tagged"
    shutil.copytree(default_model_path(), repo / "snapshots" / ("b" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "v1.0").write_text("b" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ran = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: ran.append(True))
    argv = ["lm-eval", "run", "--model", "hf", "--tasks", TASK, "--model_args", "pretrained=someone/tagged"]
    assert cli.main([*argv[:-1], "pretrained=someone/tagged,revision=v1.0"]) == 0 and ran
    with pytest.raises(FileNotFoundError, match=r"someone/tagged is not a local folder, and it is not in the local "
                                                r"Hub cache at revision v2\.0 while the Hub is off"):
        evaluation.check_model_args(["--model_args", "pretrained=someone/tagged,revision=v2.0"])
    with pytest.raises(FileNotFoundError, match=r"not in the local Hub cache while"):  # (main: not cached)
        evaluation.check_model_args(argv[-2:])
    # a revision lm-eval reads as a number (a tag "2"), and a checkpoint in a subfolder of the repo
    (repo / "refs" / "2").write_text("b" * 40)
    evaluation.check_model_args(["--model_args", "pretrained=someone/tagged,revision=2"])
    shutil.copytree(default_model_path(), repo / "snapshots" / ("c" * 40) / "inner")
    (repo / "refs" / "main").write_text("c" * 40)
    evaluation.check_model_args(["--model_args", "pretrained=someone/tagged,subfolder=inner"])
    folder = shutil.copytree(default_model_path(), tmp_path / "local" / "inner")  # a local folder's subfolder too
    assert cli.main([*argv[:-1], f"pretrained={folder.parent},subfolder=inner"]) == 0 and ran


def test_a_checkpoints_refused_saved_setting_is_named_before_the_model_loads(monkeypatch, capsys, tmp_path):
    """A draft_loops past the loops (or an exit past them) in the checkpoint's generation_config.json: lm-eval's
    first generate raised it after the model loaded, naming no file and blaming a value the user never passed."""
    import lm_eval.__main__

    folder = tmp_path / "model"
    shutil.copytree(default_model_path(), folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    ran = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: ran.append(True))
    argv = ["lm-eval", "run", "--model", "hf", "--tasks", TASK, "--model_args", f"pretrained={folder}"]
    for saved, named in (({"exit_at_step": 9}, ": exit_at_step=9 must be an integer in [0, 3] for a 4-loop model"),
                         ({"draft_loops": 5}, " sets draft_loops=5, which its model refuses (draft_loops=5 is "
                                              "outside [1, 3]")):
        (folder / "generation_config.json").write_text(json.dumps({**settings, **saved}))
        assert cli.main(argv) == 2 and not ran
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"hf-loopspec lm-eval: error: the checkpoint's generation_config.json{named}" in line, line
    assert line.endswith("pass --gen_kwargs draft_loops=N or --gen_kwargs speculative_mode=None, or correct the "
                         "checkpoint's generation_config.json."), line
    for fix in ("speculative_mode=None", "draft_loops=1"):  # the overrides the message names run
        assert cli.main([*argv, "--gen_kwargs", fix]) == 0 and ran.pop()
    # an exit option in --model_args replaces the file's, as from_pretrained stores it
    (folder / "generation_config.json").write_text(json.dumps({**settings, "exit_at_step": 9}))
    assert cli.main([*argv[:-1], f"pretrained={folder},exit_at_step=2"]) == 0 and ran.pop()
    # one the model refuses is blamed on --model_args, not on a file that has none (or another value); Huginn's too
    huginn = tmp_path / "huginn"
    tiny_huginn(seed=1)[0].save_pretrained(huginn)
    for model, given in ((folder, "exit_at_step=9"), (folder, "exit_threshold=2"), (huginn, "num_steps=0"),
                         (huginn, "init_scale=-1.0")):
        assert cli.main([*argv[:-1], f"pretrained={model},{given}"]) == 2 and not ran
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"hf-loopspec lm-eval: error: --model_args: {given} must be") \
            and line.endswith("; correct --model_args."), line
    # a num_steps=1 there that makes a speculative call refuse is blamed on it, not on the file (which has none); one
    # of the call's own (--gen_kwargs) sets the loop count, over the file's
    pipeline = ["--gen_kwargs", "speculative_mode=pipeline,draft_loops=1"]
    assert cli.main([*argv[:-1], f"pretrained={huginn},num_steps=1", *pipeline]) == 2 and not ran
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("hf-loopspec lm-eval: error: --model_args: speculative decoding drafts from a shallower "
                           "loop than the last, but this call runs 1 loop") and "generation_config" not in line, line
    settings = json.loads((huginn / "generation_config.json").read_text())
    (huginn / "generation_config.json").write_text(json.dumps({**settings, "num_steps": 1}))
    assert cli.main([*argv[:-1], f"pretrained={huginn}", *pipeline[:-1], f"{pipeline[-1]},num_steps=4"]) == 0
    assert ran.pop()
    # a saved num_steps every call refuses is the file's; a --model_args one replaces it, as from_pretrained stores
    # it. --gen_kwargs reaches generate alone: lm-eval's scoring ran the saved value and failed once requests ran
    (huginn / "generation_config.json").write_text(json.dumps({**settings, "num_steps": 0}))
    assert cli.main([*argv[:-1], f"pretrained={huginn}"]) == 2 and not ran
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("hf-loopspec lm-eval: error: the checkpoint's generation_config.json: num_steps=0 must be")
    assert cli.main([*argv[:-1], f"pretrained={huginn}", "--gen_kwargs", "num_steps=4"]) == 2 and not ran
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("hf-loopspec lm-eval: error: the checkpoint's generation_config.json: num_steps=0 must be")
    assert line.endswith("A --gen_kwargs value reaches lm-eval's generate calls only, not its loglikelihood "
                         "scoring, which runs the saved one: pass num_steps in --model_args instead (--model_args "
                         "pretrained=...,num_steps=N)."), line
    assert cli.main([*argv[:-1], f"pretrained={huginn},num_steps=4"]) == 0 and ran.pop()


def test_a_checkpoint_that_saves_stop_strings_is_named_before_the_model_loads(monkeypatch, capsys, tmp_path):
    """lm-eval's `hf` backend calls generate without a tokenizer, so a checkpoint whose generation_config.json saves
    stop strings failed in every mode once requests ran, with transformers' advice to pass a tokenizer to generate."""
    import lm_eval.__main__

    folder = tmp_path / "model"
    shutil.copytree(default_model_path(), folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, "stop_strings": ["return"]}))
    ran = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: ran.append(True))
    argv = ["lm-eval", "run", "--model", "hf", "--tasks", TASK, "--model_args", f"pretrained={folder}"]
    assert cli.main(argv) == 2 and not ran
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("hf-loopspec lm-eval: error: the checkpoint's generation_config.json sets "
                           "stop_strings=['return'], which lm-eval's generate calls cannot match (they pass no "
                           "tokenizer): pass --gen_kwargs stop_strings=None"), line
    for cleared in ("stop_strings=None", '{"stop_strings": null}'):  # (the fix it names runs)
        assert cli.main([*argv, "--gen_kwargs", cleared]) == 0 and ran.pop()


def test_max_gen_toks_past_the_models_length_ends_in_one_line(task_dir, capsys):
    """lm-eval checks max_gen_toks against the model's length only once its requests run, with an AssertionError
    (a traceback, exit status 1); it ends in one line naming the flags now."""
    code = cli.main(["lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={default_model_path()}",
                     "--tasks", TASK, "--include_path", str(task_dir), "--device", "cpu", "--limit", "1",
                     "--gen_kwargs", "max_gen_toks=5000"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("hf-loopspec lm-eval: error: Invalid configuration: requested max tokens "
                                         "to generate (5000)") and "pass a smaller --gen_kwargs max_gen_toks" in line


@pytest.mark.parametrize("batch_size", ["abc", "0", "auto:x", "auto:0", "²"])  # (² is a digit int() refuses)
def test_a_bad_batch_size_ends_in_one_line_before_anything_loads(monkeypatch, capsys, batch_size):
    """lm-eval read `--batch_size abc` once the model had loaded: `invalid literal for int()`, naming no flag."""
    import lm_eval.__main__

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval ran"))
    code = cli.main(["lm-eval", "run", "--model", "hf", "--tasks", TASK, "--batch_size", batch_size])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"hf-loopspec lm-eval: error: --batch_size {batch_size}: pass a whole number >= 1, "
                                 "auto (the largest batch that fits) or auto:N (detected again N times)."]
    for good in ("8", "+8", "auto", "auto:4"):  # (as lm-eval reads them: int(), or float() of auto's N)
        evaluation.check_batch_size(["run", "-b", good])
    for without_value in (["run", "-b"], ["run", "--batch_size", "--tasks", TASK]):  # lm-eval's parser says so,
        evaluation.check_batch_size(without_value)  # once: the check printed a usage line of its own first
    assert capsys.readouterr().err == ""


def test_debug_shows_the_traceback_and_is_not_handed_to_lm_eval(monkeypatch):
    """docs/cli.md: `--debug` shows the traceback, for every command; lm-eval's parser refused it as unrecognized,
    and a refused argument still ended in the one line."""
    import lm_eval.__main__

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    assert cli.main(["lm-eval", "run", "--tasks", TASK, "--debug", "--limit", "1"]) == 0
    assert seen == [["lm-eval", "run", "--tasks", TASK, "--limit", "1"]]
    with pytest.raises(ValueError, match="--batch_size abc"):
        cli.main(["lm-eval", "run", "--tasks", TASK, "--batch_size", "abc", "--debug"])


@pytest.mark.parametrize("gen_kwargs, named", [
    ("max_gen_toks=abc", "max_gen_toks=abc: pass a whole number >= 1"),  # lm-eval's int(): 'invalid literal'
    ("max_gen_toks=0", "max_gen_toks=0: pass a whole number >= 1"),  # blamed a max_length=8 nobody gave
    ("max_gen_toks=-1", "max_gen_toks=-1: pass a whole number >= 1"),  # (lm-eval's parser reads it as -1.0)
    ("max_new_tokens=2.5", "max_new_tokens=2.5: pass a whole number >= 1"),  # lm-eval's int() made it 2
    ("until=123", "until=123: pass a stop string, or a JSON list of them"),  # the tokenizer's TypeError text
    ('{"until": ["a", 5]}', "until=['a', 5]: pass a stop string"),
    ("temperature=hot", "temperature='hot': pass a number >= 0"),  # lm-eval's float(): 'could not convert'
    ("temperature=None", "temperature=None: pass a number >= 0"),  # lm-eval's float(None): a TypeError traceback
    ('{"temperature": "0.5", "do_sample": true}', "temperature='0.5': pass a number"),  # generate refused it mid-run
    ("speculative_mode=pipeline,num_speculative_tokens=-2", "num_speculative_tokens=-2: pass a whole number >= 1"),
    # transformers' "could not locate a tokenizer", mid-run: lm-eval's generate calls pass none
    ("stop_strings=return", "stop_strings='return': lm-eval calls generate without the tokenizer"),
    ("return_dict_in_generate=True", "return_dict_in_generate=True: lm-eval reads generate's output as a tensor"),
])
def test_bad_gen_kwargs_end_in_one_line_before_anything_loads(monkeypatch, capsys, gen_kwargs, named):
    """Values lm-eval reads itself once its requests run, where its errors named no flag (or, for
    num_speculative_tokens=-2, which its parser hands over as -2.0, the model's 'must be an integer')."""
    import lm_eval.__main__

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval ran"))
    code = cli.main(["lm-eval", "run", "--model", "hf", "--tasks", TASK, "--gen_kwargs", gen_kwargs])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"hf-loopspec lm-eval: error: --gen_kwargs {named}")
    for good in ({"max_gen_toks": 8, "until": "\n\n"}, {"max_new_tokens": 5.0, "until": ["a", "b"]},
                 {"temperature": 0, "draft_loops": 2}, {"max_gen_toks": None, "max_tokens": 3},
                 {"max_gen_toks": "8"}):  # (a JSON string lm-eval's int() reads and turns into a number)
        evaluation.check_gen_kwargs(good)


def test_an_error_inside_lm_evals_requests_is_the_last_line_not_glued_to_its_progress_bar(monkeypatch, capsys):
    """An error raised while lm-eval's progress bar is open (a transformers refusal of a --gen_kwargs key inside the
    request loop) was printed on the bar's line, and the bar was drawn again after it: the error now has the last
    line to itself."""
    import lm_eval.__main__
    from tqdm import tqdm

    def requests_failing():
        bar = tqdm(total=2, desc="Running generate_until requests")
        bar.update(1)
        raise ValueError("The following `model_kwargs` are not used by the model: ['bogus_key']")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", requests_failing)
    assert cli.main(["lm-eval", "run", "--tasks", TASK]) == 2
    gc.collect()  # (an open bar drew itself again when it was collected)
    err = capsys.readouterr().err.rstrip("\n").split("\n")
    assert err[-1] == ("hf-loopspec lm-eval: error: The following `model_kwargs` are not used by the model: "
                       "['bogus_key']")
    assert "Running generate_until requests" in err[-2]
