"""The ingress's side of its worker replicas: delta channels and what a worker's failure means to a client."""
