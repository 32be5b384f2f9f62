"""The engine core: sequences, the continuous-batching scheduler, KV blocks, prefix hashes and KV events."""
