"""The decoder runtime on adtape: decoder-only transformers (GPT-2, the Llama family) trained
and sampled on the CPU, with their model families (``gpt2.families``), parameter layout,
tokenizers, data, checkpoints and performance model.  The package keeps the name
``gpt2`` it had when GPT-2 was its only family."""
