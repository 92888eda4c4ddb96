"""The bytes a loaded model's weights occupy, for the memory guard to charge it."""

from mlx.utils import tree_flatten


def weights_bytes(model) -> int:
    """Sum of the parameters' `nbytes`: packed weights, scales and biases as loaded."""
    return sum(value.nbytes for _, value in tree_flatten(model.parameters()))
