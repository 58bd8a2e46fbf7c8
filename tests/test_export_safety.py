"""`export` never leaves wrong weights, foreign code or a half-written folder: `--overwrite` replaces the previous
export as a set (no stale weights file or index survives, sharded or not), symlinks inside OUT are replaced and
never written through, hidden entries (.git) are kept, a failed export leaves OUT and its parent exactly as they
were, and the source tokenizer's remote-code pointers are dropped (or the export refuses, naming them). Tiny
checkpoints built here; the oracle for the weights is the source's safetensors file."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_utils import save_checkpoint, snapshot
from safetensors.torch import load_file
from transformers import AutoTokenizer

import hf_loopspec
from hf_loopspec import cli
from hf_loopspec.hub import export, staging

FOREIGN = ["evil/repo--tokenization_evil.EvilTokenizer", None]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two tiny checkpoints with different weights: {'a': folder, 'b': folder}."""
    root = tmp_path_factory.mktemp("sources")
    return {name: save_checkpoint(root / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}


def run_export(src, out, *extra: str) -> None:
    assert cli.main(["export", str(src), str(out), "--benchmarks", "none", *extra]) == 0


def assert_weights_of(out, src) -> None:
    """OUT loads exactly SRC's tensors, and every safetensors file in OUT is one the load reads."""
    index = out / "model.safetensors.index.json"
    shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    assert {p.name for p in out.glob("*.safetensors")} == shards
    loaded = hf_loopspec.OuroForCausalLM.from_pretrained(out).state_dict()
    expected = load_file(src / "model.safetensors")
    assert set(expected) <= set(loaded)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_overwrite_replaces_the_previous_export_as_a_set(sources, tmp_path, capsys):
    out = tmp_path / "OUT"
    run_export(sources["a"], out)
    assert (out / "model.safetensors").is_file()
    run_export(sources["b"], out, "--max-shard-size", "100KB", "--overwrite")  # sharded over unsharded
    assert not (out / "model.safetensors").exists() and len(list(out.glob("*.safetensors"))) > 1
    assert_weights_of(out, sources["b"])
    run_export(sources["a"], out, "--overwrite")  # unsharded over sharded: no dangling index
    assert not (out / "model.safetensors.index.json").exists()
    assert_weights_of(out, sources["a"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]  # no staging folder left beside OUT
    capsys.readouterr()


def test_overwrite_keeps_the_folder_it_writes_into(sources, tmp_path, monkeypatch):
    """Exporting into the working folder (a clone of the Hub repo) replaces its contents, not the folder: the shell
    that ran it still stands in the export (a replaced folder left it in a deleted one, where `ls` shows nothing)."""
    out = tmp_path / "OUT"
    run_export(sources["a"], out)
    inode = out.stat().st_ino
    monkeypatch.chdir(out)
    run_export(sources["b"], ".", "--overwrite")
    assert out.stat().st_ino == inode and os.path.samefile(os.getcwd(), out)
    assert (Path.cwd() / "config.json").is_file()
    assert_weights_of(out, sources["b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]  # nothing left beside OUT


def test_overwrite_replaces_symlinks_and_a_file_named_custom_generate_and_keeps_hidden_entries(sources, tmp_path):
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "weights").write_bytes(b"not to be touched")
    (outside / "dir" / "generate.py").write_text("not to be touched")
    out = tmp_path / "OUT"
    (out / ".git").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "custom_generate").write_text("a file where export writes a folder")
    (out / "stale.txt").write_text("from an earlier export")
    os.symlink(outside / "weights", out / "model.safetensors")
    os.symlink(outside / "dir", out / "modeling_ouro.py")
    os.symlink(outside / "weights", out / ".link")
    before = snapshot(outside)

    run_export(sources["a"], out, "--overwrite")
    assert snapshot(outside) == before
    assert not (out / "model.safetensors").is_symlink() and not (out / "modeling_ouro.py").is_symlink()
    assert (out / "custom_generate" / "generate.py").is_file() and not (out / "stale.txt").exists()
    assert (out / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert os.readlink(out / ".link") == str(outside / "weights")  # kept as a link, not followed
    assert_weights_of(out, sources["a"])


def test_a_failed_export_leaves_out_and_its_parent_as_they_were(sources, tmp_path, monkeypatch):
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the previous weights")
    before = snapshot(tmp_path)
    # Fails after the weights and tokenizer are written into the staging folder.
    monkeypatch.setattr(export, "SHIM_FILES", ("configuration_ouro.py", "no_such_template.py"))
    with pytest.raises(FileNotFoundError, match="no_such_template.py"):
        export.export_checkpoint(sources["a"], out, overwrite=True, benchmarks=None)
    with pytest.raises(FileNotFoundError):
        export.export_checkpoint(sources["a"], tmp_path / "new" / "deeper" / "OUT", benchmarks=None)
    assert snapshot(tmp_path) == before


def test_refusals_before_anything_is_written(sources, tmp_path, capsys):
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    inner = tmp_path / "OUT" / "src"
    shutil.copytree(sources["a"], inner)
    before = snapshot(tmp_path)
    cases = [
        ([str(sources["a"]), str(out)], "is not empty; pass --overwrite"),
        ([str(sources["a"]), str(out), "--overwrite", "--max-shard-size", "5XB"], "is not a size"),
        ([str(sources["a"]), str(tmp_path / "link"), "--overwrite"], "is a symlink"),
        ([str(inner), str(out), "--overwrite"], "is or contains the source checkpoint"),
        ([str(sources["a"]), str(out / "keep.txt"), "--overwrite"], "exists and is not a folder"),
    ]
    for argv, message in cases:
        assert cli.main(["export", *argv, "--benchmarks", "none"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where nobody can create a folder")
def test_a_folder_that_cannot_be_written_is_named_before_the_model_loads(sources, monkeypatch, capsys):
    """OUT in a folder nobody can write to (root included: /proc) is refused naming OUT and the fix before the model
    loads (it failed after, naming only the hidden staging folder)."""
    monkeypatch.setattr(export, "resolve_source", lambda spec: pytest.fail("the source was read"))
    assert cli.main(["export", str(sources["a"]), "/proc/hf-loopspec-out", "--benchmarks", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/proc/hf-loopspec-out: cannot write in /proc" in err, err
    assert "pass an OUT in a folder you can write to" in err and ".partial" not in err


def test_a_mount_point_is_refused_before_the_model_loads(sources, tmp_path, monkeypatch, capsys):
    """An OUT that is a mount point (a container's volume) is refused naming it and a folder inside it as the fix:
    the export moves its files in from beside OUT, which fails across file systems (it failed after the load, naming
    the hidden staging folder). The crossing is simulated: `os.rename` into OUT fails as Linux's does (EXDEV)."""
    out = tmp_path / "OUT"
    out.mkdir()
    rename = os.rename

    def across(src, dst, *args, **kwargs):
        if Path(dst).parent == out:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", across)
    monkeypatch.setattr(export, "resolve_source", lambda spec: pytest.fail("the source was read"))
    assert cli.main(["export", str(sources["a"]), str(out), "--benchmarks", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} is a mount point" in err and f"e.g. {out / 'model'}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"] and not any(out.iterdir())


def test_the_next_export_removes_what_one_killed_while_moving_left(sources, tmp_path):
    """An export killed between moving OUT's previous entries aside and moving the new ones in leaves OUT partly
    replaced and a hidden `.OUT.*.old` folder; the next export to OUT removes that folder (it stayed for good) and
    writes a whole set, and leaves the hidden folders of other OUTs alone (those of `OUT.b`, `OUT[1]`, or a name
    that shares its first 200 characters: they are another export's, maybe still running). A name of 250 characters
    works too, and one of 120 two-byte characters (the hidden folders' names are cut to fit in bytes, with a digest of
    the whole name)."""
    long, other, wide = "n" * 250, "n" * 200 + "m" * 50, "\u00e9" * 120  # (the last: 240 bytes in UTF-8)
    others = [tmp_path / name for name in (".OUT.b.0123abcd.old", ".OUT[1].0123abcd.partial")]
    for name in ("OUT", long, wide):
        out = tmp_path / name
        run_export(sources["a"], out)
        old = staging._unique(out, "old")
        others.append(staging._unique(tmp_path / other, "old"))
        for folder in (old, *others):
            folder.mkdir(exist_ok=True)
            (folder / "model.safetensors").write_bytes(b"the previous weights")
        (out / "config.json").unlink()  # moved aside before the kill
        run_export(sources["b"], out, "--overwrite")
        assert not old.exists() and (out / "config.json").is_file()
        assert all(folder.is_dir() for folder in others)
        assert_weights_of(out, sources["b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["OUT", long, wide, *(p.name for p in others)])


def with_foreign_tokenizer_code(src, folder, *, class_known: bool):
    """A copy of `src` whose tokenizer_config.json points AutoTokenizer at another repo's code (and config.json at a
    remote pipeline); `class_known=False` also drops the tokenizer class, so only that code could load it."""
    shutil.copytree(src, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": FOREIGN}
    if not class_known:
        settings.pop("tokenizer_class", None)
        settings.pop("backend", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    config = json.loads((folder / "config.json").read_text())
    config["custom_pipelines"] = {"text-generation": {"impl": "evil/repo--pipe.Pipe"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_export_drops_remote_code_pointers_it_did_not_write(sources, tmp_path):
    src = with_foreign_tokenizer_code(sources["a"], tmp_path / "src", class_known=True)
    out = tmp_path / "OUT"
    export.export_checkpoint(src, out, benchmarks=None)
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".md", ".py", ".txt"):
            assert "evil/repo" not in path.read_text(), path
    assert json.loads((out / "config.json").read_text())["auto_map"] == export.AUTO_MAP
    # The card's tokenizer line is what the folder needs, run without remote code: it trusts the repo as the model
    # load does (config.json's auto_map would make transformers ask), but the tokenizer itself runs none.
    card = (out / "README.md").read_text()
    line = re.search(r"^tok = AutoTokenizer\.from_pretrained\(repo, .*\)$", card, flags=re.MULTILINE)[0]
    assert "trust_remote_code=True" in line
    scope = {"AutoTokenizer": AutoTokenizer, "repo": str(out)}
    exec(line.replace("trust_remote_code=True", "trust_remote_code=False"), scope)  # noqa: S102  (the card's code)
    source_tok = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    assert scope["tok"]("w5 w6 w7")["input_ids"] == source_tok("w5 w6 w7")["input_ids"] == [5, 6, 7]


def test_export_refuses_a_tokenizer_that_needs_its_own_code(sources, tmp_path):
    src = with_foreign_tokenizer_code(sources["a"], tmp_path / "src", class_known=False)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="loads only with its own remote code.*evil/repo--tokenization_evil"):
        export.export_checkpoint(src, tmp_path / "OUT", benchmarks=None)
    assert snapshot(tmp_path) == before


def test_the_card_of_a_source_without_tokenizer_loads_the_base_models(tmp_path):
    src = save_checkpoint(tmp_path / "src", seed=3, tokenizer=False)
    out = export.export_checkpoint(src, tmp_path / "OUT", base_model="ByteDance/Ouro-1.4B", benchmarks=None)
    assert not (out / "tokenizer_config.json").exists()
    assert ('tok = AutoTokenizer.from_pretrained("ByteDance/Ouro-1.4B", padding_side="left")  # this repo ships no '
            "tokenizer") in (out / "README.md").read_text()


@pytest.mark.parametrize(("bad", "message"), [
    ({"benchmarks": [{"x": 1}]}, r"benchmarks\[0\] is not an `hf-loopspec bench --json` result"),  # (a KeyError)
    ({"benchmarks": "bench.json"}, r"benchmarks='bench.json' must be a list"),  # (read letter by letter)
    ({"benchmarks": [123]}, r"benchmarks\[0\]=123: give a bench result"),  # (a TypeError in pathlib)
    ({"benchmarks": [{"rows": [], "machine": None, "args": {}, "model": {}}]}, r"benchmarks\[0\] is not"),
    ({"license": 5}, r"license=5 is not a Hub license id: give one such as apache-2.0"),  # (a TypeError)
    ({"tags": "abc"}, r"tags='abc' must be a list of strings"),  # (the tags a, b and c)
    ({"sampling": "x"}, r"sampling='x' must be a dict"),
    ({"sampling": {"temperature": -1}}, r"sampling \(the base model's card\): temperature=-1 must be a number > 0"),
    ({"sampling": {"top_k": 1.5}}, r"sampling .*: top_k=1.5 must be an integer >= 0"),
    ({"exit_options": "x"}, r"exit_options='x' must be a dict of Ouro's exit options"),
    ({"exit_options": {"exit_threshold": "x"}}, r"exit_threshold='x' must be a number in \[0, 1\]"),
    ({"exit_options": {"exit_at_step": None}}, r"that choose an exit"),  # (the card said it decodes from it)
    ({"draft_loops": 99}, r"draft_loops=99"),  # (written into the card unchecked)
    ({"repo_id": None}, r"repo_id=None: the card needs the repo"),
    ({"family": ["ouro"]}, r"family=\['ouro'\] has no card text"),
    ({"kv_bytes_per_token": "x"}, r"kv_bytes_per_token='x' must be an integer >= 1"),
])
def test_card_arguments_are_checked(bad, message):
    """`build_model_card`'s arguments failed deep inside with a KeyError, TypeError or AttributeError, or were read
    wrongly without a word; `export_checkpoint` passes them on, and refuses a bad one before anything is written."""
    with pytest.raises(ValueError, match=message):
        hf_loopspec.hub.build_model_card(**{"repo_id": "a/b"} | bad)


def test_what_an_export_carries_from_its_source_is_written_as_it_is():
    """`export` fills the card's repo id from the source's name and its license and base model from the source's
    card; the Hub form of `--repo-id` / `--base-model` is checked on the flags only, so a folder named with a space or
    a local base model still export (the first card checks refused them, naming flags never passed). A license is a
    Hub license id wherever it comes from (the Hub refuses a card with another). A sampling setting left None is left
    out of the card, a numpy one written plainly."""
    card = hf_loopspec.hub.build_model_card(
        repo_id="your-username/name with space", license="apache-2.0", base_model="./local/ckpt",
        sampling={"temperature": np.float32(0.5), "top_p": None}, num_loops=np.int64(4)).content
    assert "name with space" in card and "license: apache-2.0" in card and "./local/ckpt" in card
    assert "do_sample=True, temperature=0.5)" in card and "top_p" not in card.split("gen = dict(")[1].split(")")[0]


def test_export_refuses_bad_arguments_before_writing(tmp_path):
    for bad, message in (({"benchmarks": [{"x": 1}]}, r"benchmarks\[0\]"), ({"license": 5}, "--license 5"),
                         ({"tags": "abc"}, "tags='abc'")):
        with pytest.raises(ValueError, match=message):
            export.export_checkpoint("default", tmp_path / "out", **bad)
    with pytest.raises(ValueError, match="out=None: give the path of the folder to write"):
        export.export_checkpoint("default", None)
    assert not (tmp_path / "out").exists()
