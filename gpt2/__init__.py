"""GPT-2 on the adtape runtime: configuration, parameter layout, tokenizers, data and checkpoints."""
