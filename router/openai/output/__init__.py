"""What a client gets back: whole responses and stream chunks, their schema, SSE framing, reasoning apart from content."""
