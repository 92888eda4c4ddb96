"""`omlx bench`: offline and serving benchmarks that give the same answer twice.

workload     context lengths, exact token counts, seeded synthetic prompts
runs         one timed generation (omlx's loop, or stock mlx-lm)
memory       MLX and process peak memory per run
variants     settings under test (`--profile`, `--set`, `--compare A B`)
offline      interleaved warm-up and repeats in one process -> document
serving      concurrent streaming requests to an OpenAI-compatible server -> document
sse          server-sent events as OpenAI-compatible servers stream them
text_prompts prompts of about N tokens for a server whose tokenizer we cannot see
report       the document's header: date, versions, hardware fingerprint
stats        median/mean/stddev/min/max, percentiles, bootstrap ratio intervals
compare      ratios between variants or against a stored run; the CI gate
schema       the versioned JSON document (`omlx.bench/1`)
render       table, Markdown and CSV views of a document
"""
