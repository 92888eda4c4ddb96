"""Decode-speed paths: how decode-sized inputs (1..64 tokens) of quantized linears are
computed when not by mlx-lm's own modules. The decode kernel itself is a registered
kernel (`omlx_core.kernels.qmm_decode`); this package holds the non-kernel alternative,
a resident dense copy (`dense_copy`)."""
