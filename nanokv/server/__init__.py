"""Serving: the async engine loop (async_engine.py), the OpenAI-compatible FastAPI app
(openai_api.py: routes and errors; serving.py: request handling and streaming; protocol.py,
responses.py; chat templates: nanokv/engine/chat.py), draining shutdown (shutdown.py) and
`nanokv serve` (cli.py). The load tester that drives a server is a client:
nanokv/workloads/loadtest.py."""
