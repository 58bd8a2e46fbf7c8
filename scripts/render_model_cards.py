#!/usr/bin/env python
"""Render the model cards of the hf-loopspec variants of ByteDance's Ouro checkpoints into `model_cards/`.

    python scripts/render_model_cards.py                      # model_cards/Ouro-1.4B-loopspec/README.md, ...
    python scripts/render_model_cards.py --namespace my-org   # the Hub namespace used in the cards' code

Writes `model_cards/<variant>-loopspec/README.md` for Ouro-1.4B, Ouro-2.6B, Ouro-1.4B-Thinking and
Ouro-2.6B-Thinking, and `model_cards/TEMPLATE.md` (the card template with its `${fields}`). The text comes from
`hf_loopspec.hub.card` and its template `hf_loopspec/hub/templates/model_card.md` (edit them there, then rerun this
script); the speed section quotes the `hf-loopspec bench --json` results given with `--bench-json` (none by default).
These are the same cards `hf-loopspec export ByteDance/Ouro-1.4B OUT` writes, without downloading anything.
The embedded default model's card (`model_cards/hf-loopspec-default/`) is not written here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hf_loopspec import KVLayout, PagedLoopCache  # noqa: E402
from hf_loopspec.hub.card import (  # noqa: E402
    EXACTNESS_COMMENT,
    MODEL_CARD_TEMPLATE,
    SPECULATION,
    SPECULATION_LIMITATIONS,
    SPECULATIVE_USAGE,
    build_model_card,
)
from hf_loopspec.hub.card_checks import is_hub_repo_id  # noqa: E402

THINKING_SAMPLING = {"temperature": 1.0, "top_p": 0.7}  # the upstream Thinking cards' recommendation
VARIANTS = {
    # name: (parameters, layers, chat template, eos ids, sampling)
    "Ouro-1.4B": ("1.4B", 24, False, None, None),  # eos: whatever the checkpoint says
    "Ouro-2.6B": ("2.6B", 48, False, None, None),
    "Ouro-1.4B-Thinking": ("1.4B", 24, True, [0, 2], THINKING_SAMPLING),
    "Ouro-2.6B-Thinking": ("2.6B", 48, True, [0, 2], THINKING_SAMPLING),
}


def what_it_is(name: str, params: str, layers: int, chat: bool) -> str:
    base = f"[ByteDance/{name}](https://huggingface.co/ByteDance/{name})"
    kind = ("the base model after supervised fine-tuning on reasoning data, chatting in the ChatML format" if chat
            else "a base (pre-trained) language model")
    return (f"The weights are those of {base}, unchanged (bf16 safetensors): {kind}. Ouro (ByteDance; "
            "[paper](https://arxiv.org/abs/2510.25741)) is a looped language model: a stack of "
            f"{layers} decoder layers (hidden size 2048, 16 heads of 128, SwiGLU MLP, RoPE, sandwich RMSNorms) is "
            f"applied U = 4 times per token with the same weights, {params} parameters in all, vocabulary 49152, "
            "Apache-2.0.")


def render(out_dir: Path, namespace: str, benchmarks: list[Path]) -> list[Path]:
    written = []
    for name, (params, layers, chat, eos, sampling) in VARIANTS.items():
        repo_id = f"{namespace}/{name}-loopspec"
        card = build_model_card(
            repo_id=repo_id, base_model=f"ByteDance/{name}", license="apache-2.0", title=f"{name}-loopspec",
            what_it_is=what_it_is(name, params, layers, chat), num_loops=4, chat=chat, eos_token_ids=eos,
            sampling=sampling, benchmarks=benchmarks, max_new_tokens=512 if chat else 128,
            tags=["ouro", "reasoning"] if chat else ["ouro"],
            kv_bytes_per_token=PagedLoopCache(KVLayout(4, layers, 16, 128)).bytes_per_token_per_depth(torch.bfloat16)
            * 4,  # every loop's KV plane: 16 kv heads of 128, bf16
        )
        path = out_dir / f"{name}-loopspec" / "README.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        card.save(path)
        written.append(path)
    template = out_dir / "TEMPLATE.md"
    template.write_text(
        "<!-- The model card template hf_loopspec/hub/templates/model_card.md (a string.Template; family text from "
        "FAMILIES in hf_loopspec/hub/card.py), with its sections of a looped model (speculation.md, "
        "speculative_usage.md, speculation_limitations.md, the exactness comment) in place; the front matter is added "
        "by build_model_card. Copied by scripts/render_model_cards.py: edit the templates, not this file. -->\n\n"
        + MODEL_CARD_TEMPLATE.safe_substitute(speculation=SPECULATION.template,
                                              speculative_usage=SPECULATIVE_USAGE.template,
                                              dtype_comment=EXACTNESS_COMMENT,
                                              speculation_limitations=SPECULATION_LIMITATIONS.template),
        encoding="utf-8")
    written.append(template)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", default="hf-loopspec", help="Hub namespace of the repos (default: %(default)s)")
    parser.add_argument("--out", default=str(ROOT / "model_cards"), help="folder of the cards (default: model_cards/)")
    parser.add_argument("--bench-json", action="append", default=[], metavar="JSON",
                        help="an `hf-loopspec bench --json` results file to quote in the speed section (repeatable; "
                             "e.g. bench_results/cpu_ouro100m_b1.json; default: none)")
    args = parser.parse_args(argv)
    if "/" in args.namespace or not is_hub_repo_id(f"{args.namespace}/x"):
        parser.error(f"--namespace {args.namespace!r} is not a Hub namespace (a user or organization name: letters, "
                     "digits, '-', '_' and '.'); the cards' repo ids are NAMESPACE/NAME-loopspec.")
    for path in render(Path(args.out), args.namespace, [Path(p) for p in args.bench_json]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
