"""Serving: the async engine loop (async_engine.py), the OpenAI-compatible FastAPI app
(openai_api.py: routes and errors; serving.py: request handling and streaming; protocol.py,
chat.py), `nanokv serve` (cli.py) and a bounded load test (loadtest.py)."""
