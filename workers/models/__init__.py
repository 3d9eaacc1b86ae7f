"""Decoder models written against the paged KV cache."""
