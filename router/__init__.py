"""pagefleet.router — the Serve ingress (OpenAI API), request validation and replica routing."""
