"""Tiered prompt cache: computed KV blocks kept in memory and on SSD, reused across requests."""
