"""An mlx-lm module restated for some of its calls, the rest left to mlx-lm's own forward.

Why: a kernel that takes over one case of a module (sdpa_decode's one-token attention,
decode_block's decode-sized layer) keeps the module's children under the same names and
its attributes, so every other call runs mlx-lm's forward on the replacement (and sees
any child replaced later, as a prefill path's wrapper), and `original()` gives mlx-lm's
module back, the same arrays, to undo the install.
"""

import mlx.nn as nn


class Restated(nn.Module):
    """A subclass restates `__call__` for its case and calls `self._forward(self, ...)`
    (mlx-lm's forward) for the rest. `OWN`: public attributes the subclass adds, which
    `original()` leaves out."""

    OWN: tuple[str, ...] = ()

    def __init__(self, original: nn.Module):
        super().__init__()
        for name, module in original.items():
            setattr(self, name, module)
        for name, value in vars(original).items():
            if not name.startswith("_"):
                setattr(self, name, value)
        object.__setattr__(self, "_kind", type(original))
        object.__setattr__(self, "_forward", type(original).__call__)

    def original(self) -> nn.Module:
        """mlx-lm's module of the same children and attributes."""
        original = self._kind.__new__(self._kind)
        nn.Module.__init__(original)
        for name, child in self.items():
            setattr(original, name, child)
        for name, value in vars(self).items():
            if not name.startswith("_") and name not in self.OWN:
                setattr(original, name, value)
        return original
