"""The output records of the Huginn family's forward calls (transformers' own, with the per-step results added)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast


@dataclass
class HuginnModelOutput(BaseModelOutputWithPast):
    r"""
    `last_hidden_state` is the coda output after the final norm (the LM head's input). `hidden_states`, when
    requested, holds the prelude output followed by the state after every recurrence step.

    step_states (`tuple(torch.FloatTensor)`, *optional*):
        The coda output (LM head input) for the state after every step, with `output_step_states=True`.
    """

    step_states: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class HuginnCausalLMOutput(CausalLMOutputWithPast):
    r"""
    step_logits (`tuple(torch.FloatTensor)`, *optional*):
        Logits after every recurrence step (step r: what `num_steps=r+1` gives), with `output_step_logits=True`.
    """

    step_logits: tuple[torch.FloatTensor, ...] | None = None
