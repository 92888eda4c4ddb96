"""The kernels omlx ships, in the order they are decided and installed.

To add one: write its module (a `SPEC`: `registry.KernelSpec`, and the module replacing
mlx-lm's), its source under `kernels/`, a `kernels.<name>` setting in
`settings/schema.py` (`kernel_setting`), and list it here. Imports stay inside
`registered()` so `omlx settings` loads no kernel code.
"""


def registered() -> tuple:
    from omlx_core.kernels import decode_block, dequantize, indexer_score, qk_norm_rope, qmm_decode, sdpa_decode

    # qk_norm_rope and decode_block build on what qmm_decode and sdpa_decode installed: after them.
    return (indexer_score.SPEC, qmm_decode.SPEC, dequantize.SPEC, sdpa_decode.SPEC, qk_norm_rope.SPEC,
            decode_block.SPEC)
