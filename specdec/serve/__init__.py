"""`specdec serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

- service.py: the engine on its own thread, admission (batch + queue), each job through the one
  request path (decoding/pipeline.py: encoding off the loop, healing, stop rule, text stream),
  shutdown (drain, then errors);
- requests.py: request bodies -> validated settings (the pipeline's Options) or OpenAI errors;
- guard.py: body limit, timeouts, connection cap, API key, content types, CORS;
- prometheus.py: /metrics through prometheus_client;
- app.py: the FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models[/{id}], /health,
  /metrics, the page at /);
- lifecycle.py: the process (`serve(Launch)`): its listening socket, the target and drafter loaded, the KV
  budget, uvicorn's thread, SIGTERM and Ctrl-C (drain, then exit);
- static/index.html: the live view (no build step, nothing fetched from outside).
"""
