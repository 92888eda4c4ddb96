"""The ane prefill lane: a share of the split targets run on Apple's Neural Engine.

Portable (runs everywhere): `banks` requantizes a slice to per-output-channel INT8 and
measures the error, `staged` builds the banks layer by layer and turns them into Core ML
procedures, `program` writes each procedure as an `.mlpackage` with coremltools. Apple
only: `runtime` compiles, loads, warms and runs them (compute units CPU_AND_NE), behind a
platform check. `lane` is what a `SplitLinear` calls.
"""
