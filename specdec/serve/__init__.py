"""`specdec serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

- service.py: the engine on its own thread, admission (batch + queue), prompt encoding off the
  loop, token healing, shutdown (drain, then errors);
- requests.py: request bodies -> validated settings or OpenAI errors;
- guard.py: body limit, timeouts, connection cap, API key, content types, CORS;
- text.py: a request's tokens as text pieces safe to stream (stop strings held back, draft vs
  target pieces for the live view);
- prometheus.py: /metrics through prometheus_client;
- app.py: the FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models[/{id}], /health,
  /metrics, the page at /);
- static/index.html: the live view (no build step, nothing fetched from outside).
"""
