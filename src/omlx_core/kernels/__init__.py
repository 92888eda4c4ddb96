"""Custom kernels, gated by where they were validated, with mlx-lm's ops as the fallback.

`registry` holds the mechanism (specs, the gating decision, installation, source loading);
`catalog` lists the kernels omlx ships; one module per kernel holds its spec and the
module that replaces mlx-lm's (e.g. `indexer_score`). Sources live in the repo's
`kernels/` directory.
"""
