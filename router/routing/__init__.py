"""Choosing a worker replica: Serve request routers, local policies, admission control and the KV-aware routing client."""
