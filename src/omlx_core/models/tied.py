"""Tied embeddings: the one module a model both looks tokens up in and multiplies as its output head."""


def tied_embedding(model, path: str) -> bool:
    """Whether the module at `path` is the input embedding of a model with tied embeddings
    (mlx-lm's models then compute their output head as `embed_tokens.as_linear`)."""
    tied = bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))
    return tied and path.endswith("embed_tokens")
