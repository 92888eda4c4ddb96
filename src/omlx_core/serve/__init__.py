"""The OpenAI-compatible server: HTTP app, engine loop, scheduler, status and metrics."""
