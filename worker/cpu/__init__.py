"""The CPU platform: compute threads, packed linear weights and the allocator settings."""
