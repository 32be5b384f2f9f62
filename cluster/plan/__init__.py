"""``pagefleet plan``: KV cache capacity, roofline and cost planning."""
