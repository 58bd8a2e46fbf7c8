"""What an export says about its source and how it finds it: `hf-loopspec export default` exports the embedded model
with the embedded model's own card (no maker claim, no paper to cite), the card's title comes from `--repo-id` or the
source's name (never OUT's folder name), a local source's card gives the lead and the license, `--benchmarks` fills
`model-index`, a Hub id fails at once when the Hub cannot be reached (no network) unless it is cached (offline, in a
real process: `test_cli_errors.test_a_real_process_prints_one_line`), and the staged folder a killed export left
beside OUT is removed by the next export. CPU, tiny models, no network."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import torch
from checkpoint_utils import save_checkpoint
from huggingface_hub import ModelCard
from processes import ROOT
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_loopspec import cli
from hf_loopspec.assets import default_model_path
from hf_loopspec.bench import report
from hf_loopspec.hub import card as hub_card
from hf_loopspec.hub import export, source

OURO = hub_card.FAMILIES["ouro"]
DEFAULT_CARD = ROOT / "model_cards" / "hf-loopspec-default" / "README.md"
BENCH_JSON = ROOT / "bench_results" / "cpu_default_b1.json"  # a recorded `hf-loopspec bench --json` result
SHAPE_JSON = ROOT / "bench_results" / "cpu_ouro100m_b1.json"  # the same, of a random-weight shape (synthetic drafts)


def lead_of(text: str) -> str:
    """The paragraphs between a card's `# title` and its first `##` section."""
    body = text.split("\n# ", 1)[1].split("\n", 1)[1]
    return body.split("\n## ", 1)[0].strip()


def assert_no_maker_claim(text: str) -> None:
    assert OURO.maker not in text and OURO.arxiv not in text and OURO.bibtex not in text
    assert "## Citation" not in text


def test_export_default_writes_the_embedded_model_with_its_own_card(tmp_path, capsys):
    out = tmp_path / "export"
    assert cli.main(["export", "default", str(out)]) == 0, capsys.readouterr().err
    weights, embedded = load_file(out / "model.safetensors"), load_file(f"{default_model_path()}/model.safetensors")
    assert weights.keys() == embedded.keys() and all((weights[k] == embedded[k]).all() for k in weights)
    card = ModelCard.load(out / "README.md")
    own = ModelCard.load(DEFAULT_CARD)
    assert card.text.lstrip().startswith("# hf-loopspec-default\n")  # the source's name, not "# export"
    assert lead_of(own.text) in card.text  # the embedded model's card says what the weights are
    assert_no_maker_claim(card.text)
    assert card.data.license == own.data.license and set(own.data.tags) <= set(card.data.tags)
    assert 'custom_generate="your-username/hf-loopspec-default"' in card.text


def test_title_lead_and_license_come_from_a_local_source_and_benchmarks_fill_model_index(tmp_path):
    src = save_checkpoint(tmp_path / "tiny-looped")
    ModelCard("---\nlicense: mit\n---\n\n# Tiny looped\n\nA tiny looped model trained by someone.\n\n## More\n\nx\n"
              ).save(src / "README.md")
    out = export.export_checkpoint(src, tmp_path / "export", benchmarks=None)
    card = ModelCard.load(out / "README.md")
    assert card.text.lstrip().startswith("# tiny-looped\n") and card.data.license == "mit"
    assert "A tiny looped model trained by someone." in card.text
    assert_no_maker_claim(card.text)
    assert card.data.eval_results is None  # no benchmarks: no model-index

    # recorded results, relabelled as measured on this checkpoint's architecture (a card quotes its own model only)
    this_model = report.model_record(AutoModelForCausalLM.from_pretrained(src), "tiny-looped")
    result = {**json.loads(BENCH_JSON.read_text()), "model": this_model}
    with pytest.raises(ValueError, match=r"--benchmarks: a result measured on 'embedded default model'"):
        export.export_checkpoint(src, tmp_path / "other", benchmarks=[BENCH_JSON])  # another model's numbers
    assert not (tmp_path / "other").exists()
    named = export.export_checkpoint(src, tmp_path / "named", repo_id="org/My-Model", benchmarks=[result])
    card = ModelCard.load(named / "README.md")
    assert card.text.lstrip().startswith("# My-Model\n") and 'custom_generate="org/My-Model"' in card.text
    metrics = {(e.metric_config, e.metric_type): e.metric_value for e in card.data.eval_results}
    for row in result["rows"]:
        assert metrics[(row["mode"], "tokens_per_second")] == pytest.approx(row["tokens_per_s"], abs=1e-4)
        if row["mode"] != "plain":
            assert metrics[(row["mode"], "speedup_vs_plain")] == pytest.approx(row["ratio_vs_plain"], abs=1e-4)
    assert {e.dataset_type for e in card.data.eval_results} == {"hf-loopspec-bench"}
    assert all(result["machine"]["device_name"] in e.dataset_name for e in card.data.eval_results)

    # a random-weight shape's result measures the engine, not this model: in the speed section, not in model-index
    shape_result = {**json.loads(SHAPE_JSON.read_text()), "model": {**this_model, "name": "ouro-100m"}}
    shape = export.export_checkpoint(src, tmp_path / "shape", benchmarks=[shape_result])
    card = ModelCard.load(shape / "README.md")
    assert card.data.eval_results is None and "ouro-100m" in card.text


def test_a_fine_tune_named_after_its_base_model_or_cast_is_not_called_the_base_weights_unchanged(tmp_path):
    """`--base-model` names a local fine-tune's parent: the card says the weights are the fine-tune's (base model
    linked) and keeps its own lead; with `--dtype` it names the dtype instead of saying "unchanged"."""
    src = save_checkpoint(tmp_path / "my-finetune")
    ModelCard("---\nlicense: mit\n---\n\n# My finetune\n\nOuro tuned on my data.\n").save(src / "README.md")
    out = export.export_checkpoint(src, tmp_path / "ft", base_model="ByteDance/Ouro-1.4B", benchmarks=None)
    text = ModelCard.load(out / "README.md").text
    base = "[ByteDance/Ouro-1.4B](https://huggingface.co/ByteDance/Ouro-1.4B)"
    assert f"The weights are those of the checkpoint my-finetune (base model: {base}), unchanged" in text
    assert f"those of {base}" not in text and "Ouro tuned on my data." in text
    assert OURO.bibtex in text  # the architecture's paper is still the one to cite

    cast = export.export_checkpoint(src, tmp_path / "bf16", dtype="bfloat16", benchmarks=None)
    assert load_file(cast / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    text = ModelCard.load(cast / "README.md").text
    assert "The weights are those of the checkpoint my-finetune, in bfloat16 (safetensors)" in text
    assert "unchanged" not in text.split("\n## ", 1)[0]


@pytest.mark.parametrize("stored, named", [(torch.float32, "bfloat16"), (torch.bfloat16, "float32")])
def test_the_default_dtype_keeps_the_stored_weights_whatever_config_json_names(stored, named, tmp_path):
    """A checkpoint whose config.json names another dtype than its weights are stored in (common on the Hub): the
    export keeps the stored weights bit for bit, as its card says ("unchanged"); transformers' dtype="auto" follows
    config.json, and the export rounded float32 weights to bfloat16 under a card that called them unchanged."""
    src = save_checkpoint(tmp_path / "src")
    if stored != torch.float32:
        AutoModelForCausalLM.from_pretrained(src, dtype=stored).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "dtype": named, "torch_dtype": named}))
    assert source.stored_dtype(str(src)) == str(stored).removeprefix("torch.")
    out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)
    assert json.loads((out / "config.json").read_text())["dtype"] == str(stored).removeprefix("torch.")
    assert "unchanged (safetensors)" in ModelCard.load(out / "README.md").text


def test_a_source_whose_shards_differ_in_dtype_is_read_whole(tmp_path):
    """`stored_dtype` reads every shard's header: with only the first shard in bfloat16, the export followed it and
    rounded the float32 shards to bfloat16 under a card calling them unchanged; now config.json's float32 decides,
    and every value is kept."""
    src = tmp_path / "src"
    AutoModelForCausalLM.from_pretrained(save_checkpoint(tmp_path / "one")).save_pretrained(src, max_shard_size="20KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 2
    first = load_file(shards[0])
    save_file({key: value.to(torch.bfloat16) for key, value in first.items()}, shards[0], metadata={"format": "pt"})
    assert source.stored_dtype(str(src)) is None
    out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    before = {key: value for shard in shards for key, value in load_file(shard).items()}
    after = {key: value for shard in out.glob("model*.safetensors") for key, value in load_file(shard).items()}
    assert before.keys() == after.keys() and all(torch.equal(before[key].float(), after[key]) for key in before)


def test_the_makers_weights_keep_the_family_citation():
    text = hub_card.build_model_card(repo_id="x/Ouro-1.4B-loopspec", base_model="ByteDance/Ouro-1.4B").text
    assert OURO.bibtex in text and "## Citation" in text
    assert_no_maker_claim(hub_card.build_model_card(repo_id="x/y", base_model="someone/ouro-finetune").text)


@pytest.mark.parametrize("cached", [False, True])
def test_an_unreachable_hub_fails_at_once_or_uses_the_cache(monkeypatch, cached):
    """No network (the metadata request raises a connection error): an uncached id fails with one OSError; a cached
    one loads from local files only (no retries against the Hub)."""
    import huggingface_hub

    def unreachable(self, repo_id, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo_id, filename, **kw: f"/cache/{filename}" if cached else None)
    if cached:
        assert source.hub_state("someone/cached-model") == (True, {})
    else:
        with pytest.raises(OSError, match=r"someone/uncached-model .*cannot be reached.*ConnectionError"):
            source.hub_state("someone/uncached-model")


def test_the_next_export_removes_the_staged_folder_of_a_killed_one(tmp_path):
    """A killed export leaves `.OUT.<random>.partial` with no writer; one that a live writer holds stays."""
    src = save_checkpoint(tmp_path / "src")
    out = tmp_path / "OUT"
    stale = tmp_path / ".OUT.0badc0de.partial"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    live = tmp_path / ".OUT.0000beef.partial"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a concurrent export holds its staged folder
        export.export_checkpoint(src, out, benchmarks=None)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".OUT.0000beef.partial", "OUT", "src"]
    finally:
        os.close(fd)
    export.export_checkpoint(src, out, benchmarks=None, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT", "src"]
