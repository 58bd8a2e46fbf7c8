"""`hf-loopspec export SRC OUT`: write a Hub-ready folder for a looped model.

`export_checkpoint(src, out)` loads SRC (a checkpoint folder, a Hub id that hf_loopspec supports, or "default": the
model embedded in the package) and writes to OUT:

* `model.safetensors` (or shards `model-0000i-of-0000n.safetensors` + index when larger than `max_shard_size`),
  through `save_pretrained`; the dtype the weights are stored in is kept unless `dtype` is given;
* the tokenizer files, when SRC has a tokenizer;
* `config.json` whose `auto_map` points at `configuration_ouro.OuroConfig`, `modeling_ouro.OuroModel` and
  `modeling_ouro.OuroForCausalLM` in OUT: small shims that import `hf_loopspec` and subclass its classes, so
  `AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` works in a process that never imported
  hf_loopspec, and `generate` takes `speculative_mode`;
* `generation_config.json` with speculative defaults (`speculative_mode`, `draft_loops`,
  `num_speculative_tokens`; a 1-loop model: `speculative_mode` None alone) besides the checkpoint's eos / pad /
  sampling settings; with a ChatML chat template (Ouro's Thinking models), `<|im_end|>` joins the eos ids, so
  generation stops at the end of the turn;
* `custom_generate/generate.py` + `requirements.txt`: the strategies for any Ouro model object
  (`model.generate(custom_generate=OUT, trust_remote_code=True, speculative_mode=...)`); like every install line the
  export writes, requirements.txt says how to install hf-loopspec from its repository (`hf_loopspec.hub.install`);
* `README.md`: the model card (`hf_loopspec.hub.card.build_model_card`). Its identity is the source's
  (`hf_loopspec.hub.source`): the title is `repo_id`'s name or the source's, the summary the lead of the source's
  own card when it has one (the embedded model's is `model_cards/hf-loopspec-default/`), and the family's maker and
  paper appear only for the maker's own weights. `--benchmarks` results fill its speed section and `model-index`.

Guarantees: the settings are checked before anything loads (`hub.card_checks`), and SRC before its weights load
(`hf_loopspec.input_checks.check_source`: safetensors only, complete files; then its config.json: the Ouro family, and
the speculative defaults against its loop count; a Hub id that is not in the local cache fails at once when the Hub
cannot be used: offline mode or no network); the folder is written beside OUT and moved into place only when
complete, so a failed export leaves OUT as it was, `--overwrite` replaces the previous export as a set, and the staged
folders a killed export left beside OUT are removed by the next export to OUT (`hf_loopspec.hub.staging`); the only
remote-code pointers in OUT are the ones the export writes (config.json's `auto_map` to the shims; a source
tokenizer's `auto_map` is dropped, and a tokenizer that cannot load without its own code is refused).

Command line: `python -m hf_loopspec.hub.export SRC OUT [options]` (`main_export`), and the `export` subcommand of
`hf-loopspec` when the CLI registers it with `add_subcommand`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

from .. import __version__
from ..defaults import DEFAULT_DRAFT_LOOPS, DEFAULT_NUM_SPECULATIVE_TOKENS, DTYPE_NAMES
from ..input_checks import check_source, hub_errors_explained
from .card_checks import SAMPLING_RANGES, check_loop_settings, is_hub_repo_id
from .install import install_command
from .shims import AUTO_MAP, SHIM_FILES, write_template
from .source import card_metadata, copy_license_files, hub_options, load_dtype, resolve_source
from .staging import check_destination, staged_folder

# transformers checks each line as `name[<op><version>]` (one comparison, no PEP 508 URLs), so the repository install
# is a comment and each bound of the package's transformers range a line of its own
CUSTOM_GENERATE_REQUIREMENTS = ("# hf-loopspec is not on PyPI yet; install it from its repository: {install}\n"
                                "hf-loopspec>={version}\n{transformers}")
DTYPES = ("auto", *DTYPE_NAMES)


def export_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    max_shard_size: str | int = "2GB",
    dtype: str | None = None,
    overwrite: bool = False,
    speculative_mode: str | None = "auto",
    draft_loops: int = DEFAULT_DRAFT_LOOPS,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    repo_id: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    benchmarks: list[dict | str | Path] | None = None,
    trust_remote_code: bool = False,
    **model_card_kwargs,
) -> Path:
    """Write the Hub-ready folder `out` for the checkpoint `src` (see the module docstring); returns `out`.

    Args:
        src: a checkpoint folder, a Hub id (`ByteDance/Ouro-1.4B`, ...) or "default" (the embedded model).
        out: the folder to write; it must be empty or missing unless `overwrite=True`.
        max_shard_size: passed to `save_pretrained` (`"2GB"`, `"500MB"`, or bytes: an integer).
        dtype: `"float32"`, `"bfloat16"`, `"float16"`, or None / `"auto"` to keep the dtype the checkpoint's weights
            are stored in (`source.load_dtype`; a config.json naming another one does not convert them).
        speculative_mode, draft_loops, num_speculative_tokens: the defaults written to `generation_config.json`
            (validated against the model's loop count; `speculative_mode=None` writes plain decoding).
        repo_id: the Hub repo the folder is meant for (the card's title and code); default
            `your-username/<the source's name>`.
        base_model: the card's `base_model`; default `src` when it is a Hub id, else the source card's.
        license: the card's license; default the source card's (with its `license_name` and `license_link`), else
            `apache-2.0`. The license files of a local `src` folder are copied (`hub.source.copy_license_files`).
        benchmarks: `hf-loopspec bench` results for the card's speed section (JSON documents or `--json` files);
            None: the card says there are no measured numbers.
        model_card_kwargs: passed to `build_model_card` (`title`, `summary`, `sampling`, `tags`, ...); a keyword
            it does not take raises a `TypeError`.

    The folder is written beside `out` and moved into place only when complete (`hf_loopspec.hub.staging`): with
    `overwrite=True` the previous contents of `out` are replaced as a set (hidden entries such as `.git` are
    kept), and a failed export leaves `out` as it was. Remote-code pointers of the source are never carried: the
    config's `auto_map` names only the shims written here, and the tokenizer's `auto_map` is dropped.

    Raises `ValueError` when `src` is not a model hf_loopspec can decode speculatively, when its tokenizer needs
    its own remote code, or for a bad setting; `FileExistsError` when `out` is not empty (and `overwrite` is
    False); `OSError` when `src` cannot be read (see `hf_loopspec.input_checks.check_source`), at once when it is a
    Hub id that is not cached and the Hub is out of reach (`hf_loopspec.hub.source.resolve_source`).
    """
    from transformers import AutoModelForCausalLM

    from .card_speed import bench_results
    from .generation_defaults import generation_defaults

    # the settings first: a bad one is refused before any Hub request
    shard_bytes = _checked_settings(max_shard_size, dtype, overwrite, trust_remote_code, repo_id, base_model, license,
                                    model_card_kwargs)
    benchmarks = bench_results(benchmarks)  # the result files too, before the model loads
    out = check_destination(out, overwrite=overwrite)
    source = resolve_source(str(src))
    src = source.path
    if Path(src).exists() and (Path(src).resolve() == out.resolve() or out.resolve() in Path(src).resolve().parents):
        raise ValueError(f"OUT ({out}) is or contains the source checkpoint {src}; export into another folder.")
    check_source(src)
    num_loops = _source_config(src, source.local_only, trust_remote_code).total_ut_steps  # no weights read yet
    check_loop_settings(num_loops, model_card_kwargs.get("exit_options"), speculative_mode, draft_loops,
                        num_speculative_tokens)
    with hub_errors_explained(src):
        model = AutoModelForCausalLM.from_pretrained(src, dtype=load_dtype(src, source.local_only, dtype),
                                                     trust_remote_code=trust_remote_code, use_safetensors=True,
                                                     **hub_options(source.local_only))
    model.eval()
    tokenizer = _load_tokenizer(src, source.local_only)
    generation_defaults(model, tokenizer, speculative_mode, draft_loops, num_speculative_tokens)
    card = _model_card(source, model, tokenizer, repo_id=repo_id, base_model=base_model, license=license,
                       benchmarks=benchmarks, dtype=dtype, **model_card_kwargs)
    with staged_folder(out) as stage:
        _write_folder(stage, model, tokenizer, shard_bytes)
        copy_license_files(source, stage)
        card.save(stage / "README.md")
        _readable_as_umask(stage)
    return out


def _checked_settings(max_shard_size, dtype, overwrite, trust_remote_code, repo_id, base_model, license,
                      model_card_kwargs: dict) -> int:
    """`max_shard_size` in bytes, after a `ValueError` for any setting of `export_checkpoint` that is checked without
    the source (`model_card_kwargs` as `build_model_card` checks them), and a `TypeError` naming a keyword that neither
    `export_checkpoint` nor `build_model_card` takes."""
    from .card import FAMILIES, build_model_card
    from .card_checks import check_card_keywords, check_card_metadata, check_flags, shard_size

    check_flags(overwrite=overwrite, trust_remote_code=trust_remote_code)
    if dtype not in (None, *DTYPES):
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}.")
    check_card_metadata(repo_id, base_model, license)
    card_keywords = [name for name in inspect.signature(build_model_card).parameters
                     if name not in inspect.signature(export_checkpoint).parameters]
    unknown = [name for name in model_card_kwargs if name not in card_keywords]
    if unknown:
        raise TypeError(f"export_checkpoint() got an unexpected keyword argument {unknown[0]!r}; the keywords it "
                        f"passes to the model card are {', '.join(card_keywords)}.")
    check_card_keywords(model_card_kwargs, FAMILIES)
    return shard_size(max_shard_size)


def _check_no_adapter(src: str, local_only: bool) -> None:
    """`ValueError` for a source that holds a PEFT adapter beside its checkpoint (`adapter_config.json`, as
    transformers finds it): `from_pretrained` loads the adapter onto the model, whose `save_pretrained` then writes
    the adapter alone, not the whole checkpoint an export is."""
    from transformers.utils import find_adapter_config_file

    if find_adapter_config_file(src, local_files_only=local_only) is not None:
        raise ValueError(f"{src} holds a PEFT adapter (adapter_config.json) beside its checkpoint, which "
                         "from_pretrained loads onto the model, and an export writes whole weights: merge the adapter "
                         "first (peft's merge_and_unload, then save_pretrained into another folder) and export that "
                         "folder, or move the adapter's files out to export the base model alone.")


def _source_config(src: str, local_only: bool, trust_remote_code: bool):
    """SRC's config, read without its weights, after a `ValueError` when SRC holds an adapter (`_check_no_adapter`)
    or is of another family than Ouro (config.json's `model_type`): its weights then load as hf_loopspec's
    `OuroForCausalLM`, whose registration wins over a checkpoint's own remote code."""
    from transformers import AutoConfig

    import hf_loopspec

    _check_no_adapter(src, local_only)

    with hub_errors_explained(src):
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code, local_files_only=local_only)
    if not isinstance(config, hf_loopspec.OuroConfig):
        raise ValueError(f"{src} has model_type {config.model_type!r}; export supports hf_loopspec's Ouro models "
                         "(model_type 'ouro').")
    return config


def _readable_as_umask(folder: Path) -> None:
    """Give every file under `folder` the mode of its `README.md`, which the process's umask set (transformers writes
    the weights owner-only, 0600, while the other files follow the umask: others could read the card but not the
    weights)."""
    mode = (folder / "README.md").stat().st_mode & 0o777
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def kv_bytes_per_token(model) -> int:
    """KV bytes one context token takes in bf16 in every loop of `model` (keys and values of each layer)."""
    import torch

    from ..cache.paged import PagedLoopCache

    return PagedLoopCache(model.kv_layout).bytes_per_token_per_depth(torch.bfloat16) * model.num_loops


def _check_measured_on(result: dict, model) -> None:
    """`ValueError` naming `--benchmarks` when a bench result was measured on another architecture than `model`'s
    (config and parameter count: the bench's own random-weight shape of this architecture passes, and its card
    section says so); a card must not quote another model's speed."""
    from ..bench.report import model_record, same_architecture

    measured, ours = result["model"], model_record(model, "SRC")
    if not same_architecture(measured, ours):
        raise ValueError(f"--benchmarks: a result measured on {measured.get('name')!r} ({measured.get('parameters')} "
                         f"parameters) is not this model's ({ours['parameters']} parameters, or another config); "
                         "pass results of `hf-loopspec bench --model SRC --json FILE`, or 'none'.")


def _model_card(source, model, tokenizer, *, repo_id, base_model, license, benchmarks, dtype,
                **model_card_kwargs):
    """The card of the export (built before anything is written, so that a bad benchmarks file fails first); its
    identity comes from `source` (a `hf_loopspec.hub.source.Source`)."""
    from ..generation.config import EXIT_OPTIONS, asks
    from ..logs import get_logger
    from .card import build_model_card, makers_weights
    from .generation_defaults import chatml_tokens

    for result in benchmarks:
        _check_measured_on(result, model)
    gen = model.generation_config
    data = source.card_data
    if base_model is None:
        base_model = source.spec if source.hub_id else data.get("base_model")
        if isinstance(base_model, str) and not is_hub_repo_id(base_model):  # (a path: the Hub would reject it)
            get_logger(__name__).warning("export: the source card's base_model %r is no Hub repo id: left out of "
                                         "the card; pass --base-model to name the base model.", base_model)
            base_model = None
    is_base = source.hub_id and base_model == source.spec  # the weights are base_model's own, not a derivative's
    card_args = {
        "repo_id": repo_id or f"your-username/{source.name}",
        "title": repo_id.rsplit("/", 1)[-1] if repo_id else source.name,
        "summary": None if is_base and makers_weights(base_model) else source.lead,  # the maker's: the family's words
        "source": None if is_base else source.description or f"[{source.spec}](https://huggingface.co/{source.spec})",
        "weights_dtype": None if dtype in (None, "auto") else dtype,
        "base_model": base_model,
        "tags": [tag for tag in data.get("tags") or () if isinstance(tag, str)],
        **card_metadata(source, license),  # license (with its name and link), language, datasets
        "num_loops": model.num_loops,
        "kv_bytes_per_token": kv_bytes_per_token(model),
        "tokenizer": tokenizer is not None,
        "chat": bool(getattr(tokenizer, "chat_template", None)),
        "chat_tokens": chatml_tokens(tokenizer),
        "eos_token_ids": gen.eos_token_id,
        "stop_strings": [gen.stop_strings] if isinstance(gen.stop_strings, str) else gen.stop_strings,
        "speculative_mode": gen.speculative_mode,
        # (a 1-loop export writes none: `generation_defaults`)
        **{key: getattr(gen, key) for key in ("draft_loops", "num_speculative_tokens") if hasattr(gen, key)},
        "benchmarks": benchmarks,
        "exit_options": {key: getattr(gen, key) for key in EXIT_OPTIONS if asks(getattr(gen, key, None))},
    }
    if gen.do_sample and "sampling" not in model_card_kwargs:
        card_args["sampling"] = {k: getattr(gen, k) for k in SAMPLING_RANGES if getattr(gen, k, None) is not None}
        card_args["sampling_source"] = "the checkpoint's `generation_config.json`"
    card_args.update(model_card_kwargs)
    return build_model_card(**card_args)


def _write_folder(folder: Path, model, tokenizer, max_shard_size: int) -> None:
    """Weights, config (auto_map: the shims only), tokenizer (no auto_map), shims and custom_generate/."""
    model.config.auto_map = dict(AUTO_MAP)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = dict(AUTO_MAP)  # in case save_pretrained rewrote it from a remote-code class
    config.pop("custom_pipelines", None)  # remote pipeline code of the source: not written by the export
    config["architectures"] = ["OuroForCausalLM"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        settings_path = folder / "tokenizer_config.json"
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
        if settings.pop("auto_map", None) is not None:  # the source's code pointers; it loaded without them
            settings_path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

    (folder / "custom_generate").mkdir()
    for name in (*SHIM_FILES, "custom_generate/generate.py"):  # shims too: a remote-code source saved its own copies
        write_template(folder, name)
    (folder / "custom_generate" / "requirements.txt").write_text(CUSTOM_GENERATE_REQUIREMENTS.format(
        install=install_command(), version=__version__, transformers=transformers_bounds()))


def transformers_bounds() -> str:
    """The installed hf-loopspec's own transformers range (its metadata, from pyproject.toml), a line per bound."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    needed = next(r for r in map(Requirement, requires("hf-loopspec")) if r.name == "transformers" and not r.marker)
    return "".join(f"transformers{bound}\n" for bound in sorted(map(str, needed.specifier)))


def _load_tokenizer(src: str, local_only: bool = False):
    """SRC's tokenizer, loaded without remote code; None when SRC has no tokenizer_config.json and none loads.

    Raises `ValueError` when SRC has a tokenizer that cannot be loaded without its own remote code (naming the
    `auto_map` entries) or cannot be loaded at all: an export never drops the tokenizer silently."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src, trust_remote_code=False, local_files_only=local_only)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        settings = _source_tokenizer_settings(src)
        if settings is None:
            return None
        if settings.get("auto_map"):
            raise ValueError(
                f"the tokenizer of {src} loads only with its own remote code (tokenizer_config.json auto_map: "
                f"{json.dumps(settings['auto_map'])}); an export never carries code it did not write, so give the "
                "source a tokenizer that loads without trust_remote_code.") from None
        reason = " ".join(str(err).split())[:300]
        raise ValueError(f"the tokenizer of {src} cannot be loaded ({type(err).__name__}: {reason}); fix or remove "
                         "its tokenizer files.") from None


def _source_tokenizer_settings(src: str) -> dict | None:
    """SRC's tokenizer_config.json ({} when it is unreadable), or None when SRC has none."""
    from transformers.utils import cached_file

    try:
        path = cached_file(src, "tokenizer_config.json", _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except OSError:
        path = None
    if path is None:
        return None
    try:
        settings = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


# --- command line ---------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `export` options (used by `main_export` and by `add_subcommand`)."""
    parser.add_argument("src", metavar="SRC", help="checkpoint folder or Hub id (e.g. ByteDance/Ouro-1.4B)")
    parser.add_argument("out", metavar="OUT", help="folder to write (must be empty unless --overwrite)")
    parser.add_argument("--max-shard-size", default="2GB",
                        help="safetensors shard size: 500MB, 2GB, ... or bytes (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights dtype (default: the one they are stored in)")
    parser.add_argument("--speculative-mode", choices=("auto", "pipeline", "block", "none"), default="auto",
                        help="default decoding written to generation_config.json (default: %(default)s)")
    parser.add_argument("--draft-loops", type=int, default=DEFAULT_DRAFT_LOOPS,
                        help="default d (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                        help="default K (default: %(default)s)")
    parser.add_argument("--repo-id", default=None, help="Hub repo id used in the model card's code")
    parser.add_argument("--base-model", default=None, help="model card base_model (default: SRC when a Hub id)")
    parser.add_argument("--license", default=None, help="model card license (default: the source's or apache-2.0)")
    parser.add_argument("--benchmarks", action="append", default=None, metavar="JSON",
                        help="an `hf-loopspec bench --json` results file to quote in the card's speed section "
                             "(repeatable; 'none' or no flag: the card says it has no measured numbers)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let SRC's own remote code load (not needed for Ouro checkpoints)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the contents of a non-empty OUT (hidden entries such as .git are kept)")
    return parser


def _benchmark_files(given: list[str] | None) -> list[str]:
    """The `--benchmarks` files; 'none' (the card has no measured numbers) only on its own."""
    given = list(given or ())
    if "none" in given and len(given) > 1:
        raise ValueError(f"--benchmarks {' '.join(given)}: 'none' says the card has no measured numbers; pass it "
                         "alone, or drop it to quote the files.")
    return [path for path in given if path != "none"]


def main_from_args(args: argparse.Namespace) -> int:
    """Run an export from parsed arguments; prints the files written. Raises ValueError / OSError on bad input."""
    out = export_checkpoint(
        args.src, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
        overwrite=args.overwrite,
        speculative_mode=None if args.speculative_mode == "none" else args.speculative_mode,
        draft_loops=args.draft_loops, num_speculative_tokens=args.num_speculative_tokens, repo_id=args.repo_id,
        base_model=args.base_model, license=args.license,
        benchmarks=_benchmark_files(args.benchmarks),
        trust_remote_code=args.trust_remote_code,
    )
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    print(f"exported {args.src} -> {out} ({len(files)} files):")
    for name in files:
        print(f"  {name}")
    print(f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `export` on an `argparse` subparsers object (the `hf-loopspec` CLI's)."""
    parser = subparsers.add_parser("export", help="write a Hub-ready folder (weights, remote code, card)",
                                   description=__doc__.split("\n\n")[0])
    return add_arguments(parser)


def main_export(argv: list[str] | None = None) -> int:
    """`python -m hf_loopspec.hub.export SRC OUT ...`: the same as `hf-loopspec export SRC OUT ...` (exit status 2
    with a one-line message on bad input, see `hf_loopspec.cli`)."""
    from ..cli import main as cli_main

    return cli_main(["export", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main_export())
