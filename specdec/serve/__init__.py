"""`specdec serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

- service.py: the engine on its own thread, the bounded queue, token healing, graceful close;
- text.py: a request's tokens as text pieces safe to stream (stop strings held back, draft vs
  target pieces for the live view);
- prometheus.py: the /metrics text;
- app.py: the FastAPI routes (/v1/completions, /v1/models, /health, /metrics, the page at /);
- static/index.html: the live view (no build step, nothing fetched from outside).
"""
