"""Small Hugging Face models for the oracle tests: transformers builds each from the
config.json we write for our own config, with random weights, as no weights can be
downloaded.  conftest.py loads this file as ``hf_models`` (tests import each other's
files nowhere: pytest runs them in importlib mode)."""
import dataclasses


def reduced(name, head_dim=16, vocab_size=384):
    """The Llama-family preset ``name`` with 2 blocks, ``head_dim`` and a small vocabulary."""
    from gpt2.config import LlamaConfig
    c = LlamaConfig.preset(name)
    return dataclasses.replace(c, n_layer=2, n_embd=c.n_head * head_dim, head_dim=head_dim,
                               intermediate_size=3 * c.n_head * head_dim + 8,
                               vocab_size=vocab_size)


def hf_class_and_config(config):
    """(transformers' model class, its configuration) for our ``config``."""
    import transformers

    from gpt2 import hf
    fields = hf.hf_config_dict(config)
    cls = getattr(transformers, fields["architectures"][0])
    return cls, transformers.AutoConfig.for_model(**{k: v for k, v in fields.items()
                                                      if k != "architectures"})


def hf_model(config, seed=0, *, spread=True, weight_std=None):
    """transformers' float32 model of ``config`` in eval mode, weights from ``seed``.

    spread: norm weights uniform in [0.5, 1.5] and biases N(0, 0.1) instead of
    transformers' ones and zeros, so that they matter; weight_std: every other weight
    N(0, weight_std) instead of transformers' initialization."""
    import torch
    cls, cfg = hf_class_and_config(config)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    if spread:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or ".ln_" in name:
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    p.normal_(0, 0.1)
                elif weight_std is not None:
                    p.normal_(0, weight_std)
    return model


def saved_hf_model(config, path, seed=0, **kwargs):
    """``hf_model(config, seed, **kwargs)`` saved by its own save_pretrained into ``path``;
    returns the model."""
    model = hf_model(config, seed, **kwargs)
    model.save_pretrained(path)
    return model
