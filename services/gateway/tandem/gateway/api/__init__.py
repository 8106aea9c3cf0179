"""The OpenAI-compatible HTTP surface: request models, error bodies, response
bodies and the route handlers that tie them to the orchestrator."""
