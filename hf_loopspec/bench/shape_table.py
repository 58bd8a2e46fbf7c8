"""The named random-weight shapes of `--model NAME` (`SHAPES`), as plain data: the command line lists them without
importing torch (`shapes.shape_config` builds their configs)."""

# Named shapes (`--model NAME`): (family, config fields). Prompt ids start at 3 (0..2 are special).
SHAPES = {
    "ouro-tiny": ("ouro", {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "total_ut_steps": 4}),
    "ouro-100m": ("ouro", {"vocab_size": 8192, "hidden_size": 768, "intermediate_size": 2048,
                           "num_hidden_layers": 12, "num_attention_heads": 12, "total_ut_steps": 4}),
    "ouro-1.4b": ("ouro", {"vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
                           "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                           "head_dim": 128, "total_ut_steps": 4}),
    "huginn-tiny": ("huginn", {"vocab_size": 256, "n_embd": 64, "n_heads": 4, "intermediate_size": 128,
                               "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1,
                               "mean_recurrence": 8}),
    # Huginn-0125's stage layout (2 + 4 + 2 sandwich blocks, 32 steps) at a CPU-sized width, and the real shape.
    "huginn-small": ("huginn", {"vocab_size": 8192, "n_embd": 512, "n_heads": 8, "intermediate_size": 1536,
                                "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
                                "mean_recurrence": 32}),
    "huginn-3.5b": ("huginn", {"vocab_size": 65536, "n_embd": 5280, "n_heads": 55, "intermediate_size": 17920,
                               "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
                               "mean_recurrence": 32}),
}
