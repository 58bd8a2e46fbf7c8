"""Files shipped inside the package.

`default_model_path()` is the folder of the embedded default model: a tiny Ouro-architecture looped LM
(U = 4 loops over 2 layers, 5.1M parameters, byte-level BPE vocabulary of 4096) trained on the CPython
standard library by `scripts/train_default_model.py` (card: `model_cards/hf-loopspec-default/`). It is for
demos and tests only:

```python
import hf_loopspec  # registers the Ouro classes with the Auto factories
from hf_loopspec.assets import default_model_path
from transformers import AutoModelForCausalLM, AutoTokenizer
path = default_model_path()
model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
```
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "default_model"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_path() -> str:
    """The folder of the embedded default model inside the installed package (loadable offline with
    `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`).

    Raises `FileNotFoundError` when the folder or one of its files is missing (e.g. a build that dropped the
    package data).
    """
    missing = [name for name in _REQUIRED if not (DEFAULT_MODEL_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"The embedded default model is missing from {DEFAULT_MODEL_DIR} (no {', '.join(missing)}). The "
            "package was installed without its data files: reinstall hf-loopspec from a wheel or checkout that "
            "includes hf_loopspec/assets/default_model/ (package data), or recreate the model with "
            "the `reproduce_command` of its training report (model_cards/hf-loopspec-default/ shows it)."
        )
    return str(DEFAULT_MODEL_DIR)


__all__ = ["DEFAULT_MODEL_DIR", "default_model_path"]
