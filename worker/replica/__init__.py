"""The worker as a Ray Serve replica: the deployment, its delta channel and its KV event publisher."""
