"""Model cards (README.md) for Hub repos of hf-loopspec models, written with `huggingface_hub.ModelCard`.

`build_model_card(...)` fills the template `templates/model_card.md` (package data; a `string.Template`: `${name}`
fields, `$$` for a dollar; a model of 2 or more loops gets the sections `speculation.md` and `speculative_usage.md`, a
1-loop model, which cannot speculate, a line saying so) and returns a `ModelCard` whose front matter has `license`,
`library_name: transformers`, `pipeline_tag: text-generation`, `base_model` (when known) and the tags
`looped-language-model`, `speculative-decoding` and `custom_generate`.

Family-specific text (the name, the remote-code shims, the chat template's token ids, the citation, ...) comes from
`FAMILIES`, one `CardFamily` per model family that `hf_loopspec.hub.export` exports (Ouro today). The card names the
family's maker and asks for the family's paper to be cited only for the maker's own weights (a `base_model` in the
maker's Hub namespace); for any other weights its identity is the source's (`source`, `summary`, `what_it_is`). The
speed section and the `model-index` metadata come from `hf-loopspec bench` results passed in (`benchmarks`: JSON
documents or `--json` files; see `hf_loopspec.hub.card_speed`), never from text the bench printed or from files of a
source checkout. Install lines come from `hf_loopspec.hub.install` (the project URL of the package metadata).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from huggingface_hub import ModelCard, ModelCardData

from ..generation.config import DEFAULT_DRAFT_LOOPS, DEFAULT_NUM_SPECULATIVE_TOKENS
from .card_checks import check_card_arguments
from .card_speed import bench_results, eval_results, speed_section
from .install import install_command, project_url

TAGS = ("looped-language-model", "speculative-decoding", "custom_generate")
MODEL_CARD_TEMPLATE, SPECULATION, SPECULATIVE_USAGE, SPECULATION_LIMITATIONS = (
    Template(resources.files(__package__).joinpath("templates", name).read_text(encoding="utf-8"))
    for name in ("model_card.md", "speculation.md", "speculative_usage.md", "speculation_limitations.md"))
# (the last three: models of U >= 2, as is the code's comment on fp32)
EXACTNESS_COMMENT = "  # fp32: speculative equals plain, token for token"
NO_SPECULATION = ("**No self-speculation.** This model runs its stack once per token (U = 1): it has no shallower "
                  "loop to draft from, so it decodes plainly, and `generate` refuses the speculative modes.\n")


@dataclass(frozen=True)
class CardFamily:
    """What a card says that depends on the model family."""

    name: str  # as in prose: "Ouro"
    maker: str
    hub_namespace: str  # the maker's Hub namespace: a base_model there is the maker's own weights
    paper: str  # URL
    arxiv: str  # arXiv id
    bibtex: str
    shim_files: tuple[str, ...]  # the remote-code files the export writes
    chat_tokens: dict[str, int]  # the ChatML tokens of the family's chat models and their ids
    kv_example: str  # the KV read per context token of one real checkpoint
    limitations: str = ""  # extra Limitations bullets (Markdown, each line ending in a newline)


FAMILIES = {
    "ouro": CardFamily(
        name="Ouro",
        maker="ByteDance",
        hub_namespace="ByteDance",
        paper="https://arxiv.org/abs/2510.25741",
        arxiv="2510.25741",
        bibtex="""@article{zhu2025ouro,
  title   = {Scaling Latent Reasoning via Looped Language Models},
  author  = {Zhu, Rui-Jie and Wang, Zixuan and Hua, Kai and Zhang, Tianyu and others},
  journal = {arXiv preprint arXiv:2510.25741},
  year    = {2025}
}""",
        shim_files=("configuration_ouro.py", "modeling_ouro.py"),
        chat_tokens={"<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 0},
        kv_example="about 786 KB per context token for Ouro-1.4B in bf16 across its 4 loops",
        limitations="* **Early exit.** `generate` decodes from the last loop (the checkpoints' `early_exit_threshold` "
                    "of 1.0); the\n  exit gate, where the checkpoint trained one, is available through "
                    "`forward(exit_threshold=...,\n  exit_at_step=..., use_weighted_exit=True)`.\n",
    ),
}


def _exit_limitation(exit_options: dict) -> str:
    """The Limitations bullet of a repo whose generation config sets an exit option."""
    given = ", ".join(f"`{key}={value!r}`" for key, value in exit_options.items())
    return (f"* **Exit.** This repo's `generation_config.json` sets {given}: `generate` decodes from that exit, not "
            "from the last loop,\n  in every mode, and `forward` scores from it (pass another exit option to "
            "override it;\n  `exit_threshold=1.0` selects the last loop).\n")


def build_model_card(
    *,
    repo_id: str,
    base_model: str | None = None,
    license: str = "apache-2.0", license_name: str | None = None, license_link: str | None = None,
    title: str | None = None, summary: str | None = None, what_it_is: str | None = None,
    num_loops: int = 4,
    tokenizer: bool = True,
    chat: bool = False,
    chat_tokens: dict[str, int] | None = None,
    eos_token_ids: list[int] | int | None = None, stop_strings: list[str] | None = None,
    sampling: dict | None = None,
    sampling_source: str = "the base model's card",
    speculative_mode: str | None = "auto",
    draft_loops: int = DEFAULT_DRAFT_LOOPS,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    benchmarks: Sequence[dict | str | Path] | None = None,
    family: str = "ouro",
    source: str | None = None,
    weights_dtype: str | None = None,
    prompt: str = "def fibonacci(n):",
    max_new_tokens: int = 128,
    tags: tuple[str, ...] | list[str] = (),
    language: str | list[str] | None = None, datasets: list[str] | None = None,
    kv_bytes_per_token: int | None = None,
    exit_options: dict | None = None,
) -> ModelCard:
    """A `ModelCard` for an exported hf-loopspec repo (see the module docstring).

    `benchmarks`: `hf-loopspec bench` results for the speed section, as JSON documents or paths of `--json` files (None
    or empty: the card says there are no measured numbers). `family`: a key of `FAMILIES`. `tokenizer=False` (the repo
    ships no tokenizer) loads the base model's tokenizer in the code. `chat=True` (models with a chat template, such as
    the Thinking variants) shows chat-template usage, and the card names the ids of its ChatML tokens (`chat_tokens`:
    `{token: id}` of the repo's tokenizer, `{}` for a template that is not ChatML; None: the family's); `sampling` (e.g.
    `{"temperature": 1.0, "top_p": 0.7}`) is used in every example, with `do_sample=True`, and credited to
    `sampling_source` (where the settings come from). `source`: how the prose names weights that are not the family
    maker's (e.g. "the embedded model hf-loopspec-default"); with `base_model` too, the weights are the source's and
    `base_model` is named as theirs (a fine-tune's parent). `weights_dtype`: the dtype the export stored the weights in
    (None: as the source stores them). The title defaults to the repo's name and is the card's `model_name` (a re-export
    keeps it); `language`, `datasets`, `license_name` and `license_link`: `_card_data`'s. `kv_bytes_per_token`: this
    model's KV bytes per context token in bf16, every loop together (None: the family's example). `exit_options`: the
    exit the repo's generation config sets (None: the last loop). `stop_strings`: those it saves (None: none), which
    the card names and its code matches by passing the tokenizer to `generate`."""
    sampling = check_card_arguments(FAMILIES, **locals())  # (card_checks: every argument, by name)
    fam = FAMILIES[family]
    results = bench_results(benchmarks)  # a bad results file fails before anything is built
    eos = [int(id_) for id_ in ([eos_token_ids] if isinstance(eos_token_ids, numbers.Integral)  # (numpy as Python)
                                else eos_token_ids or [])]
    base_link = f"[{base_model}](https://huggingface.co/{base_model})" if base_model and "/" in base_model else None
    makers = makers_weights(base_model, family)
    # None: the prose says "the source checkpoint"
    weights = f"{source} (base model: {base_link})" if source and base_link else source or base_link
    fields = {
        "title": title or repo_id.rsplit("/", 1)[-1],
        "summary": summary or _summary(weights or f"a looped language model with the {fam.name} architecture",
                                       weights_dtype, num_loops),
        "what_it_is": what_it_is or _what_it_is(fam, weights, weights_dtype, makers, num_loops),
        "project_url": project_url(),
        "install_command": install_command(),
        "family": fam.name,
        "shim_files": " and ".join(f"`{name}`" for name in fam.shim_files),
        "repo_id": repo_id,
        "base_model_or_repo": base_model or repo_id,
        "num_loops": num_loops,
        "generation_defaults": _generation_defaults(speculative_mode, draft_loops, num_speculative_tokens, eos,
                                                    num_loops, stop_strings),
        "tokenizer_code": _tokenizer_code(tokenizer, base_model),
        "inputs_code": _inputs_code(chat, prompt),
        "generate_kwargs": _generate_kwargs(max_new_tokens, sampling, eos if chat else [], bool(stop_strings)),
        "variant_section": _variant_section(fam, chat, chat_tokens, eos, sampling, sampling_source),
        "speed_section": speed_section(results, repo_id, num_loops),
        "kv_example": fam.kv_example if kv_bytes_per_token is None else
        f"about {_size(kv_bytes_per_token)} per context token for this model in bf16 across its {num_loops} loops",
        "family_limitations": _exit_limitation(exit_options) if exit_options else fam.limitations,
        "citation_section": _citation_section(fam, base_link) if makers else "",
    }
    fields |= _speculation_sections(fields, num_loops)
    data = _card_data(fields["title"], results, tags, num_loops >= 2, license=license, license_name=license_name,
                      license_link=license_link, base_model=base_model, language=language, datasets=datasets)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{MODEL_CARD_TEMPLATE.substitute(fields)}")


def _card_data(title: str, results: Sequence[dict], tags, speculates: bool, **metadata) -> ModelCardData:
    """The card's front matter: `metadata` (the license with an `other` license's name and link, the base model, and
    a source card's language and datasets, carried over), the package's library, pipeline tag and tags (no
    `speculative-decoding` for a model that cannot speculate), the title as `model_name` and the bench `results` as
    `model-index`."""
    tags = [tag for tag in dict.fromkeys([*TAGS, *tags]) if speculates or tag != "speculative-decoding"]
    return ModelCardData(library_name="transformers", pipeline_tag="text-generation", model_name=title, tags=tags,
                         eval_results=eval_results(results, project_url()) or None, **metadata)


def _size(count: int) -> str:
    """A byte count as the card writes it (decimal units)."""
    return f"{count / 1e6:.1f} MB" if count >= 1e6 else f"{count / 1e3:.0f} KB" if count >= 1e3 else f"{count} bytes"


def makers_weights(base_model: str | None, family: str = "ouro") -> bool:
    """Whether `base_model` is the family maker's own checkpoint (a repo in the maker's Hub namespace)."""
    return bool(base_model) and base_model.split("/", 1)[0] == FAMILIES[family].hub_namespace


def _summary(named: str, weights_dtype: str | None, num_loops: int) -> str:
    """The card's lead when the source's card gives none: `named` says whose the weights are."""
    decoded = ("decoded with lossless pipelined or block self-speculation" if num_loops >= 2 else
               "decoded plainly (one loop per token: no shallower loop to draft from)")
    return (f"{named[0].upper() + named[1:]} packaged for transformers 5.x with [hf-loopspec]({project_url()}): the "
            f"same weights{f' in {weights_dtype}' if weights_dtype else ''}, loadable with `trust_remote_code=True`, "
            f"{decoded}.")


def _what_it_is(fam: CardFamily, weights: str | None, weights_dtype: str | None, makers: bool, num_loops: int) -> str:
    """The card's first words on the weights (stored as they came, or in `weights_dtype`): the maker and the paper
    only for the maker's weights or a model based on them."""
    stored = f"in {weights_dtype}" if weights_dtype else "unchanged"
    loop = f"one stack of layers is applied U = {num_loops} times per token with the same weights"
    whose = f"those of {weights}" if weights else "the source checkpoint's"
    if makers:
        return (f"The weights are {whose}, {stored} (safetensors). {fam.name} ({fam.maker}; "
                f"[paper]({fam.paper})) is a looped language model: {loop}.")
    return (f"The weights are {whose}, {stored} (safetensors): a looped language model with the {fam.name} "
            f"architecture, in which {loop}.")


def _citation_section(fam: CardFamily, base_link: str) -> str:
    return (f"\n## Citation\n\nThe base model {base_link} is {fam.name}, from {fam.maker} "
            f"([arXiv:{fam.arxiv}]({fam.paper})); please cite the paper when you use it.\n\n"
            f"```bibtex\n{fam.bibtex}\n```\n")


def _generate_kwargs(max_new_tokens: int, sampling: dict | None, chat_eos: list[int], stops: bool) -> str:
    """The `gen = dict(...)` of the card's code; a chat model with several eos ids stops on all of them, and the
    stop strings a repo's generation config saves (`stops`) are matched with the tokenizer `generate` is given."""
    kwargs = f"max_new_tokens={max_new_tokens}"
    if sampling:
        kwargs += ", do_sample=True" + "".join(f", {k}={v!r}" for k, v in sampling.items())
    else:
        kwargs += ", do_sample=False"
    if len(chat_eos) > 1:
        kwargs += f", eos_token_id={chat_eos}"
    return kwargs + (", tokenizer=tok" if stops else "")


def _inputs_code(chat: bool, prompt: str) -> str:
    if chat:
        return ('messages = [{"role": "user", "content": "How many positive divisors does 360 have?"}]\n'
                "inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\",\n"
                "                                 return_dict=True).to(model.device)")
    return (f"inputs = tok([{json.dumps(prompt)}, \"def is_prime(n):\"], return_tensors=\"pt\", "
            "padding=True).to(model.device)")


def settle_pad(gen, tokenizer, vocab_size: int) -> None:
    """Give an export's generation config `gen` a pad id, and its tokenizer (None: it has none) a pad token, inside
    the model's vocabulary (`vocab_size` ids), so that the card's quickstart, which pads a batch of two prompts, runs
    on the exported tokenizer (padding positions are embedded too: an id past the vocabulary is refused).

    `gen.pad_token_id`, when None or outside the vocabulary, becomes the first eos id, else 0. A tokenizer without a
    pad token, or with one outside the vocabulary, gets the token of that id when it is one of the tokenizer's
    special tokens (its eos token, typically); an ordinary word is not made the pad token (it would become special,
    and `skip_special_tokens` would drop it from decoded text): the export then warns that the quickstart cannot pad.
    """
    def inside(token_id) -> bool:
        return isinstance(token_id, int) and 0 <= token_id < vocab_size

    if not inside(gen.pad_token_id):
        eos = gen.eos_token_id
        eos = eos[0] if isinstance(eos, list) and eos else eos
        gen.pad_token_id = eos if inside(eos) else 0
    if tokenizer is None or inside(tokenizer.pad_token_id):
        return
    if gen.pad_token_id in tokenizer.all_special_ids:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(gen.pad_token_id)
        return
    from ..logs import get_logger

    get_logger(__name__).warning(
        "export: the tokenizer has no pad token inside the model's %d ids, and id %d is none of its special tokens, "
        "so the card's quickstart, which pads two prompts, fails on it; give the source's tokenizer a pad token of "
        "the vocabulary (e.g. tokenizer.pad_token = tokenizer.eos_token, then save it) and export again.",
        vocab_size, gen.pad_token_id)


def _tokenizer_code(tokenizer: bool, base_model: str | None) -> str:
    """The card's tokenizer line: the repo's own tokenizer, else the base model's. The repo's is loaded with
    `trust_remote_code=True`, as the model is: its own code is none (the export drops tokenizer `auto_map`s), but
    transformers reads the repo's config.json, whose `auto_map` names the shims, and without the flag asks on a
    terminal whether to run them (a process that loads the tokenizer before the model, without hf_loopspec)."""
    if tokenizer:
        return 'tok = AutoTokenizer.from_pretrained(repo, trust_remote_code=True, padding_side="left")'
    source = json.dumps(base_model or "<the tokenizer the weights were trained with>")
    return (f"tok = AutoTokenizer.from_pretrained({source}, padding_side=\"left\")  "
            "# this repo ships no tokenizer")


def _speculation_sections(fields: dict, num_loops: int) -> dict:
    """The card's self-speculation prose, usage snippets, exactness comment and limitations, and what its
    `custom_generate/` offers; a 1-loop model, which cannot speculate, gets a line saying so and none of the rest."""
    looped = num_loops >= 2
    return {"custom_generate_offers": "the same strategies" if looped else "the same decoding",
            "speculation": SPECULATION.substitute(fields) if looped else NO_SPECULATION,
            "speculative_usage": SPECULATIVE_USAGE.substitute(fields) if looped else "",
            "dtype_comment": EXACTNESS_COMMENT if looped else "",
            "speculation_limitations": SPECULATION_LIMITATIONS.substitute(fields) if looped else ""}


def _generation_defaults(mode: str | None, draft_loops: int, k: int, eos: list[int], num_loops: int,
                         stop_strings: list[str] | None = None) -> str:
    """What the card says of the defaults written to `generation_config.json`: only modes those defaults can run
    (pipeline mode needs `draft_loops` to divide `num_loops`; auto then weighs plain and block only), and where
    generation stops (its eos ids, and its stop strings, which `generate` matches with the tokenizer it is given)."""
    where = f"token {' or '.join(str(e) for e in eos)}" if eos else "the checkpoint's eos token"
    if stop_strings:
        where += f" or once the text holds one of the stop strings {list(stop_strings)!r} (pass `tokenizer=tok`)"
    stops = f"generation stops at {where}"
    pipeline = num_loops % draft_loops == 0
    divisors = ", ".join(str(d) for d in range(1, num_loops) if num_loops % d == 0)
    if mode is None and num_loops < 2:
        return f"plain decoding ({stops}; a 1-loop model has no shallower loop to draft from)"
    if mode is None:
        if pipeline:
            return (f"plain decoding by default ({stops}); pass `speculative_mode=\"pipeline\"` or `\"block\"` to "
                    "speculate")
        return (f"plain decoding by default ({stops}); pass `speculative_mode=\"block\"` to speculate from loop "
                f"{draft_loops} (`\"pipeline\"` needs a `draft_loops` that divides {num_loops}: {divisors})")
    settings = f'`speculative_mode="{mode}"`, `draft_loops={draft_loops}`'
    if mode == "auto":
        modes = ", in block or in pipeline mode" if pipeline else " or in block mode"
        why = "" if pipeline else f" (pipeline mode needs a `draft_loops` that divides {num_loops}: {divisors})"
        return (f"self-speculative decoding is on by default ({settings}: each call decodes plainly{modes} from "
                f"loop {draft_loops}, whichever the costs measured on the device and the draft acceptance it "
                f"observes make fastest{why}; {stops}); pass `speculative_mode=None` for transformers' plain loop")
    if mode == "block":
        settings += f", `num_speculative_tokens={k}`"
    return (f"self-speculative decoding is on by default ({settings}; {stops}); pass `speculative_mode=None` for "
            "transformers' plain loop")


def _chat_template(tokens: dict[str, int]) -> str:
    """How the card names a chat template whose ChatML tokens have the ids `tokens` (none: not ChatML)."""
    if "<|im_end|>" not in tokens:
        return "a chat template"
    ids = ", ".join(f"`{token}` = {tokens[token]}" for token in ("<|im_start|>", "<|im_end|>") if token in tokens)
    document = f" and a document with `<|endoftext|>` = {tokens['<|endoftext|>']}" if "<|endoftext|>" in tokens else ""
    return f"a ChatML chat template ({ids}). A turn ends with `<|im_end|>`{document}"


def _variant_section(fam: CardFamily, chat: bool, chat_tokens: dict[str, int] | None, eos: list[int],
                     sampling: dict | None, sampling_source: str) -> str:
    if not chat and not sampling:
        return ""
    lines = ["", "### Chat and sampling settings", ""]
    if chat:
        stops = " and ".join(str(e) for e in eos) if eos else "the tokenizer eos"
        template = _chat_template(fam.chat_tokens if chat_tokens is None else chat_tokens)
        lines.append(f"The tokenizer carries {template}; this repo's `generation_config.json` "
                     f"stops on {stops}.")
    if sampling:
        settings = ", ".join(f"{k}={v}" for k, v in sampling.items())
        lines.append(f"Sampling settings recommended by {sampling_source}: {settings}. Speculative sampling in "
                     "hf-loopspec is lossless (drafts are accepted with probability min(1, p/q) and rejections are "
                     "resampled from the residual), so these settings give the same output distribution in every "
                     "mode.")
    return "\n".join(lines) + "\n"


__all__ = ["FAMILIES", "MODEL_CARD_TEMPLATE", "TAGS", "CardFamily", "build_model_card", "makers_weights"]
