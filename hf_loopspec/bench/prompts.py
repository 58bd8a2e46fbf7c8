"""The benchmark's prompts: seeded random ids for random weights, else slices of a built-in text (`PROMPT_CODE`,
Python source, for the embedded model, which was trained on Python; `PROMPT_TEXT`, English, for other
checkpoints) or of `--prompt-file`."""

from __future__ import annotations

import torch

# Prompt texts for models with a tokenizer (repeated and cut to --prompt-len tokens; row b starts further in):
# Python source for the embedded default model (trained on Python code), English prose for other checkpoints.
# Both are written for this benchmark, so no model has seen them verbatim.
PROMPT_TEXT = (
    "The river town woke slowly. Fishermen checked their nets by lantern light while the baker pulled the "
    "first loaves from the oven, and the smell of bread drifted over the water. A schoolteacher walked along "
    "the quay, counting the boats as she always did, and noticed that one was missing. She asked the harbour "
    "master, who looked at his ledger and frowned: the boat had left before dawn with two passengers and no "
    "cargo. Question: if twelve boats left at six and three of them came back by nine, how many were still "
    "out? Answer: nine boats were still out, because twelve minus three is nine. The teacher wrote the number "
    "on her slate, thanked him, and went on to the school, where the children were already arguing about "
    "whether a boat without cargo could still be called a trading boat. "
)
PROMPT_CODE = '''
class Ledger:
    """Keep a running balance of named accounts and a log of every transfer."""

    def __init__(self, accounts=None):
        self._balances = dict(accounts or {})
        self._log = []

    def balance(self, name):
        """Return the balance of account *name*, or 0 if it has never been used."""
        return self._balances.get(name, 0)

    def transfer(self, source, target, amount):
        if amount <= 0:
            raise ValueError(f"amount must be positive, not {amount!r}")
        if self.balance(source) < amount:
            raise ValueError(f"insufficient funds in {source!r}")
        self._balances[source] = self.balance(source) - amount
        self._balances[target] = self.balance(target) + amount
        self._log.append((source, target, amount))

    def history(self, name=None):
        """Return the transfers that touch account *name* (all of them when *name* is None)."""
        if name is None:
            return list(self._log)
        return [entry for entry in self._log if name in entry[:2]]


def parse_line(line):
    """Split a line of the form 'source -> target: amount' into its three parts."""
    left, _, amount = line.partition(":")
    source, _, target = left.partition("->")
    return source.strip(), target.strip(), int(amount)
'''


def make_prompts(tokenizer, vocab: int, batch: int, length: int, seed: int, text: str = PROMPT_TEXT) -> torch.Tensor:
    """`[batch, length]` prompt ids: slices of `text` with a tokenizer, else seeded random ids in [3, vocab)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab, (batch, length), generator=gen)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the prompt text tokenizes to no tokens; pass a longer --prompt-file.")
    stride = 7
    need = length + stride * batch
    ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor([ids[b * stride : b * stride + length] for b in range(batch)])
