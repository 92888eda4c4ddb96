"""Load a resolved model with mlx-lm: the one place model weights come into memory."""

from omlx_core.errors import OmlxError
from omlx_core.models.resolve import ModelRef


def load_model(model: ModelRef, lazy: bool = False):
    """Return mlx-lm's (model, tokenizer) for a resolved checkpoint; `lazy` leaves the
    weights unread until used (enough to inspect the module structure)."""
    from mlx_lm.utils import load

    try:
        return load(str(model.path), lazy=lazy)
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise OmlxError(f"{model.path}: mlx-lm could not load it: {error}") from error
