"""Model cards (README.md) for Hub repos of hf-loopspec models, written with `huggingface_hub.ModelCard`.

`build_model_card(...)` fills `MODEL_CARD_TEMPLATE` (a `string.Template`: `${name}` fields, `$$` for a dollar)
and returns a `ModelCard` whose front matter has `license`, `library_name: transformers`,
`pipeline_tag: text-generation`, `base_model` (when known) and the tags `looped-language-model`,
`speculative-decoding` and `custom_generate`.

The speed section comes from the project's `BENCHMARKS.md` (`parse_benchmarks`): every subsection of its
"Results" section that holds a results table is quoted with its command and machine; a subsection whose title says
it is not a result (e.g. "Smoke run (not a result)") is left out. When there is no measured table, the card says so
instead of showing numbers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from huggingface_hub import ModelCard, ModelCardData

from ..generation.config import DEFAULT_DRAFT_LOOPS, DEFAULT_NUM_SPECULATIVE_TOKENS

TAGS = ("looped-language-model", "speculative-decoding", "custom_generate")
OURO_PAPER = "https://arxiv.org/abs/2510.25741"
OURO_BIBTEX = """@article{zhu2025ouro,
  title   = {Scaling Latent Reasoning via Looped Language Models},
  author  = {Zhu, Rui-Jie and Wang, Zixuan and Hua, Kai and Zhang, Tianyu and others},
  journal = {arXiv preprint arXiv:2510.25741},
  year    = {2025}
}"""

MODEL_CARD_TEMPLATE = Template('''# ${title}

${summary}

## What it is

${what_it_is}

This repository adds three small pieces to the weights, all served by the
[hf-loopspec](https://pypi.org/project/hf-loopspec/) package:

* `configuration_ouro.py` and `modeling_ouro.py`: remote-code shims that import `hf_loopspec`, so
  `AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` returns hf-loopspec's native Ouro for
  transformers 5.x (correct left-padded batches, the 5.x cache API) without any import on your side.
* `generation_config.json`: ${generation_defaults}.
* `custom_generate/`: the same strategies for an Ouro model object loaded any other way
  (`model.generate(..., custom_generate="${repo_id}", trust_remote_code=True)`); it wraps the model in
  hf-loopspec's Ouro class without copying a single weight.

**Self-speculation.** A looped model runs one shared stack U = ${num_loops} times per token, and every loop's
output can be decoded by the same LM head. hf-loopspec drafts tokens from loop d and verifies them at loop U,
reusing all of the draft's work: a token's first d loops are both its draft and the start of its verification,
and the KV cache keeps one plane per loop. *Block* mode drafts K tokens, then verifies them in one pass; *pipeline*
mode keeps a wavefront of tokens at different loops and runs all of them in ONE call of the stack per step, so
with drafts from loop 1 of 4 that are all accepted it commits one token per call instead of one per 4 calls.
Greedy output is token-identical to plain decoding (in fp32), and sampled output follows exactly the model's own
distribution (lossless speculative sampling).

## Usage

```bash
pip install hf-loopspec   # transformers >= 5.24, torch >= 2.4; add triton for the CUDA kernels
```

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "${repo_id}"
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True, dtype=torch.bfloat16, device_map="cuda")
${tokenizer_code}
${inputs_code}
gen = dict(${generate_kwargs})
```

Without remote code, `import hf_loopspec` first and load the repo (or `${base_model_or_repo}`) without
`trust_remote_code`: the package registers Ouro with the Auto classes.

**Plain decoding** (transformers' own loop, U calls of the stack per token):

```python
out = model.generate(**inputs, **gen, speculative_mode=None)
print(tok.batch_decode(out, skip_special_tokens=True))
```

**Block self-speculation** (K drafts from loop d, then one verification pass over them):

```python
out = model.generate(**inputs, **gen, speculative_mode="block", draft_loops=1, num_speculative_tokens=4)
```

**Pipelined self-speculation**:

```python
out = model.generate(**inputs, **gen, speculative_mode="pipeline", draft_loops=1, return_dict_in_generate=True)
print(tok.batch_decode(out.sequences, skip_special_tokens=True))
print(out.speculation.to_dict())  # core calls, drafted / accepted / rejected tokens, calls per token
```

**`custom_generate`**, for an Ouro model object that is not hf-loopspec's (another port, upstream code):

```python
out = other_model.generate(**inputs, **gen, custom_generate="${repo_id}", trust_remote_code=True,
                           speculative_mode="pipeline", draft_loops=1)
```

Everything else `generate` offers keeps working in every mode: left-padded batches, `eos_token_id` lists,
streamers (`TextStreamer`), stopping criteria and stop strings, greedy logits processors, `output_scores`.
`draft_loops` must be in [1, U-1] (pipeline: a divisor of U); beam search and assistant models cannot be combined
with a speculative mode.
${variant_section}
## Speed

${speed_section}

## Limitations

* **Exactness is an fp32 property.** In fp32, greedy speculative output equals plain greedy output token for
  token (the package's tests assert it). In bf16 / fp16, calls with different row counts round differently, so
  near-tied logits can flip and the two outputs can diverge after some tokens; measure agreement with plain
  decoding rather than expect identity. Sampling is lossless in distribution, not in the random stream.
* **Long contexts and large batches.** Speculation pays off at short and medium contexts and small batches, where
  a call of the stack is bound by reading the weights. The per-loop KV cache holds U = ${num_loops} planes, and
  the KV read per token grows with the context (about 786 KB per context token for Ouro-1.4B in bf16 across its 4
  loops): at a few thousand tokens of context, or at large batch where calls are already compute bound, extra
  lanes are no longer free and the speed-up shrinks or vanishes. The model's long-context quality is the base
  model's; this package does not change the weights.
* **Early exit.** `generate` decodes from the last loop (the checkpoints' `early_exit_threshold` of 1.0); the
  exit gate is available through `forward(exit_threshold=..., exit_at_step=..., use_weighted_exit=True)`.
* **Remote code needs the package.** The shims import `hf_loopspec`; without it, loading fails with
  "pip install hf-loopspec". With `trust_remote_code=True`, transformers also routes `model.generate` through
  `custom_generate/generate.py`, which calls hf-loopspec's `generate` unchanged.

## Citation

${citation_intro}

```bibtex
${bibtex}
```
''')


@dataclass
class BenchmarkResult:
    """One measured entry of BENCHMARKS.md: a subsection with at least one results table."""

    title: str
    machine: str | None
    command: str | None
    tables: list[str] = field(default_factory=list)  # markdown tables (or verbatim fenced blocks)
    synthetic: bool = False
    settings: list[str] = field(default_factory=list)  # bench header lines ("hf-loopspec bench | ...")


# --- BENCHMARKS.md -------------------------------------------------------------------------------------------------
_NOT_A_RESULT = re.compile(r"not a result|smoke|placeholder|dry run", re.IGNORECASE)
_FENCE = re.compile(r"^```([\w+-]*)\s*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_BENCH_COLUMNS = ("mode", "tok/s", "x plain", "x ar", "ideal", "%ideal", "overhd", "calls/tok", "accept", "peak mem")
_CARD_COLUMNS = (("mode", 0), ("tok/s", 1), ("× plain", 2), ("× ar", 3), ("calls/token", 7), ("acceptance", 8))


def parse_benchmarks(text: str) -> list[BenchmarkResult]:
    """The measured results of a BENCHMARKS.md text (see the module docstring); `[]` when there are none."""
    results_part = _section(text, level=2, title_pattern=r"results?\b") or ""
    subsections = _split_headings(results_part, level=3) or [("Results", results_part)]
    found = []
    for title, body in subsections:
        if _NOT_A_RESULT.search(title):
            continue
        result = _parse_entry(title, body)
        if result.tables:
            found.append(result)
    return found


def _section(text: str, level: int, title_pattern: str) -> str | None:
    marks = "#" * level
    heading = re.compile(rf"^{marks}\s+(.*)$", re.MULTILINE)
    for m in heading.finditer(text):
        if re.match(title_pattern, m.group(1).strip(), re.IGNORECASE):
            end = len(text)
            nxt = re.compile(rf"^#{{1,{level}}}\s", re.MULTILINE).search(text, m.end())
            if nxt:
                end = nxt.start()
            return text[m.end():end]
    return None


def _split_headings(text: str, level: int) -> list[tuple[str, str]]:
    heading = re.compile(rf"^{'#' * level}\s+(.*)$", re.MULTILINE)
    matches = list(heading.finditer(text))
    return [(m.group(1).strip(), text[m.end(): matches[i + 1].start() if i + 1 < len(matches) else len(text)])
            for i, m in enumerate(matches)]


def _parse_entry(title: str, body: str) -> BenchmarkResult:
    result = BenchmarkResult(title=title, machine=None, command=None)
    for paragraph in re.split(r"\n\s*\n", _FENCE.sub("", body)):
        paragraph = " ".join(line.strip() for line in paragraph.strip().splitlines())
        if result.machine is None and re.match(r"(machine|hardware|device)\s*:", paragraph, re.IGNORECASE):
            result.machine = paragraph.split(":", 1)[1].strip()
        if "SYNTHETIC" in paragraph.upper():
            result.synthetic = True
    for fence in _FENCE.finditer(body):
        lang, content = fence.group(1).lower(), fence.group(2)
        if lang in ("bash", "sh", "shell", "console") and result.command is None:
            result.command = content.strip()
        elif lang in ("json",):
            continue
        else:
            table = _bench_text_table(content, result)
            if table is not None:
                result.tables.append(table)
    for block in _pipe_tables(_FENCE.sub("", body)):
        if _has_number(block):
            result.tables.append(block)
    return result


def _bench_text_table(content: str, result: BenchmarkResult) -> str | None:
    """A markdown table from `hf-loopspec bench` text output (`format_table`), or None when `content` is not one."""
    lines = content.splitlines()
    header = next((i for i, line in enumerate(lines) if line.split()[:2] == ["mode", "tok/s"]), None)
    if header is None:
        return None
    for line in lines[:header]:
        if line.startswith("hf-loopspec bench |"):
            result.settings.append(line.strip())
        if "SYNTHETIC ACCEPTANCE" in line:
            result.synthetic = True
    rows = []
    for line in lines[header + 1:]:
        parts = line.split()
        if not parts or set(line.strip()) <= {"-"}:
            continue
        if len(parts) < len(_BENCH_COLUMNS) or not _is_number(parts[1]):
            break  # the footnote lines after the table
        check = " ".join(parts[len(_BENCH_COLUMNS):]) or "-"
        rows.append([parts[i] for _, i in _CARD_COLUMNS] + [check])
    if not rows:
        return None
    head = [name for name, _ in _CARD_COLUMNS] + ["check"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def _pipe_tables(text: str) -> list[str]:
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.strip().startswith("|"):
            current.append(line.rstrip())
        else:
            if len(current) >= 3 and re.match(r"^\|?\s*:?-{3,}", current[1].strip()):
                tables.append("\n".join(current))
            current = []
    return tables


def _is_number(text: str) -> bool:
    return re.fullmatch(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?%?", text) is not None


def _has_number(table: str) -> bool:
    cells = [c.strip() for line in table.splitlines()[2:] for c in line.strip().strip("|").split("|")]
    return any(_is_number(c) for c in cells)


def speed_section(results: list[BenchmarkResult]) -> str:
    """The card's speed section: the measured tables with command and machine, or a plain statement of none."""
    if not results:
        return ("No measured speed numbers yet: hf-loopspec's `BENCHMARKS.md` had no recorded results when this card "
                "was written, so this card shows none. Measure on your own hardware with `hf-loopspec bench --model "
                "<repo or folder>` (it checks every speculative output against plain decoding and prints tokens/s, "
                "core calls per token and draft acceptance). What can be said without a measurement is the call "
                "count: plain decoding runs the shared stack U times per token, pipelined drafting from loop d runs "
                "it about d + (U - d)(1 - a) times per token at draft acceptance a; whether fewer calls mean less "
                "time depends on the hardware (see Limitations).")
    parts = [("Measured with `hf-loopspec bench` and copied from hf-loopspec's `BENCHMARKS.md` (each table names "
              "its machine and command; tokens/s are for all sequences of the batch, prefill included).")]
    for r in results:
        parts.append(f"### {r.title}")
        if r.synthetic:
            parts.append("**Synthetic acceptance:** random weights, with drafts replaced by the known greedy token at "
                         "a fixed rate (verification is real). This measures the decoding engine, not this model's "
                         "drafts.")
        if r.machine:
            parts.append(f"Machine: {r.machine}")
        for setting in r.settings:
            parts.append(f"Settings: `{setting}`")
        if r.command:
            parts.append(f"Command:\n\n```bash\n{r.command}\n```")
        parts.extend(r.tables)
    return "\n\n".join(parts)


def default_benchmarks_path() -> Path | None:
    """`BENCHMARKS.md` of a source checkout (beside the package folder), or None when it is not there."""
    path = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
    return path if path.is_file() else None


# --- the card ------------------------------------------------------------------------------------------------------
def build_model_card(
    *,
    repo_id: str,
    base_model: str | None = None,
    license: str = "apache-2.0",
    title: str | None = None,
    summary: str | None = None,
    what_it_is: str | None = None,
    num_loops: int = 4,
    tokenizer: bool = True,
    chat: bool = False,
    eos_token_ids: list[int] | int | None = None,
    sampling: dict | None = None,
    speculative_mode: str | None = "pipeline",
    draft_loops: int = DEFAULT_DRAFT_LOOPS,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    benchmarks: str | Path | None = "default",
    prompt: str = "def fibonacci(n):",
    max_new_tokens: int = 128,
    tags: tuple[str, ...] | list[str] = (),
) -> ModelCard:
    """A `ModelCard` for an exported hf-loopspec repo (see the module docstring).

    `benchmarks` is a path to a BENCHMARKS.md, its text, `"default"` (the checkout's file when there is one) or
    None (no benchmark file: the card says there are no measured numbers). `tokenizer=False` (the repo ships no
    tokenizer) loads the base model's tokenizer in the code. `chat=True` (models with a chat
    template, such as the Thinking variants) shows chat-template usage; `sampling` (e.g. `{"temperature": 1.0,
    "top_p": 0.7}`) is used in every example, with `do_sample=True`.
    """
    name = repo_id.rsplit("/", 1)[-1]
    eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
    base_link = f"[{base_model}](https://huggingface.co/{base_model})" if base_model and "/" in base_model else None
    generate_kwargs = f"max_new_tokens={max_new_tokens}"
    if sampling:
        generate_kwargs += ", do_sample=True" + "".join(f", {k}={v!r}" for k, v in sampling.items())
    else:
        generate_kwargs += ", do_sample=False"
    if chat and len(eos) > 1:
        generate_kwargs += f", eos_token_id={eos}"
    if chat:
        inputs_code = (
            'messages = [{"role": "user", "content": "How many positive divisors does 360 have?"}]\n'
            "inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\",\n"
            "                                 return_dict=True).to(model.device)"
        )
    else:
        inputs_code = (f"inputs = tok([{json.dumps(prompt)}, \"The capital of France is\"], return_tensors=\"pt\", "
                       "padding=True).to(model.device)")
    fields = {
        "title": title or name,
        "summary": summary or (
            f"{base_link or 'An Ouro looped language model'} packaged for transformers 5.x with "
            "[hf-loopspec](https://pypi.org/project/hf-loopspec/): the same weights, loadable with "
            "`trust_remote_code=True`, decoded with lossless pipelined or block self-speculation."),
        "what_it_is": what_it_is or (
            f"The weights are {'those of ' + base_link + ', unchanged' if base_link else 'an Ouro checkpoint'} "
            f"(safetensors). Ouro (ByteDance; [paper]({OURO_PAPER})) is a looped language model: one stack of "
            f"layers is applied U = {num_loops} times per token with the same weights."),
        "repo_id": repo_id,
        "base_model_or_repo": base_model or repo_id,
        "num_loops": num_loops,
        "generation_defaults": _generation_defaults(speculative_mode, draft_loops, num_speculative_tokens, eos),
        "tokenizer_code": _tokenizer_code(tokenizer, base_model),
        "inputs_code": inputs_code,
        "generate_kwargs": generate_kwargs,
        "variant_section": _variant_section(chat, eos, sampling),
        "speed_section": speed_section(_load_benchmarks(benchmarks)),
        "citation_intro": (f"The base model{' ' + base_link if base_link else ''} is Ouro, from ByteDance "
                           f"([arXiv:2510.25741]({OURO_PAPER})); please cite the paper when you use it."),
        "bibtex": OURO_BIBTEX,
    }
    data = ModelCardData(
        license=license, library_name="transformers", pipeline_tag="text-generation", base_model=base_model,
        tags=list(dict.fromkeys([*TAGS, *tags])),
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{MODEL_CARD_TEMPLATE.substitute(fields)}")


def _tokenizer_code(tokenizer: bool, base_model: str | None) -> str:
    """The card's tokenizer line: the repo's own tokenizer (it never needs remote code: the export drops tokenizer
    `auto_map`s), else the base model's."""
    if tokenizer:
        return 'tok = AutoTokenizer.from_pretrained(repo, padding_side="left")'
    source = json.dumps(base_model or "<the tokenizer the weights were trained with>")
    return (f"tok = AutoTokenizer.from_pretrained({source}, padding_side=\"left\")  "
            "# this repo ships no tokenizer")


def _generation_defaults(mode: str | None, draft_loops: int, k: int, eos: list[int]) -> str:
    where = f"token {' or '.join(str(e) for e in eos)}" if eos else "the checkpoint's eos token"
    stops = f"generation stops at {where}"
    if mode is None:
        return (f"plain decoding by default ({stops}); pass `speculative_mode=\"pipeline\"` or `\"block\"` to "
                "speculate")
    settings = f'`speculative_mode="{mode}"`, `draft_loops={draft_loops}`'
    if mode == "block":
        settings += f", `num_speculative_tokens={k}`"
    return (f"self-speculative decoding is on by default ({settings}; {stops}); pass `speculative_mode=None` for "
            "transformers' plain loop")


def _variant_section(chat: bool, eos: list[int], sampling: dict | None) -> str:
    if not chat and not sampling:
        return ""
    lines = ["", "### Chat and sampling settings", ""]
    if chat:
        lines.append("The tokenizer carries a ChatML chat template (`<|im_start|>` = 1, `<|im_end|>` = 2). A turn ends "
                     f"with `<|im_end|>` and a document with `<|endoftext|>` = 0; this repo's `generation_config.json` "
                     f"stops on {' and '.join(str(e) for e in eos) if eos else 'the tokenizer eos'}.")
    if sampling:
        settings = ", ".join(f"{k}={v}" for k, v in sampling.items())
        lines.append(f"Sampling settings recommended by the base model's card: {settings}. Speculative sampling in "
                     "hf-loopspec is lossless (drafts are accepted with probability min(1, p/q) and rejections are "
                     "resampled from the residual), so these settings give the same output distribution in every "
                     "mode.")
    return "\n".join(lines) + "\n"


def _load_benchmarks(benchmarks: str | Path | None) -> list[BenchmarkResult]:
    if benchmarks is None:
        return []
    if benchmarks == "default":
        path = default_benchmarks_path()
        return parse_benchmarks(path.read_text(encoding="utf-8")) if path else []
    if isinstance(benchmarks, Path) or (isinstance(benchmarks, str) and "\n" not in benchmarks):
        return parse_benchmarks(Path(benchmarks).read_text(encoding="utf-8"))
    return parse_benchmarks(benchmarks)


__all__ = ["MODEL_CARD_TEMPLATE", "TAGS", "BenchmarkResult", "build_model_card", "parse_benchmarks", "speed_section"]
