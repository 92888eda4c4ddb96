"""`omlx tune`: measure prefill setups on this machine and recommend only what was verified."""
