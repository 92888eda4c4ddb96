"""Cluster enrollment, verification and launch (experimental; `cluster.enabled` is off by default).

The collective layer is `mx.distributed` launched by `mlx.launch`; this package only pairs
machines over SSH, checks them before every activation, and writes what `mlx.launch` reads.
"""
