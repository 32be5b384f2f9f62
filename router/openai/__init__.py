"""The OpenAI-compatible HTTP front: app, routes' logic, request models, preprocessing, responses, SSE, errors, guards and auth."""
