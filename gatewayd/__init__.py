"""gatewayd: Symphony's HTTP front door — `symphony serve` (serve.py), the app and its
routers (program runs over HTTP/SSE, the OpenAI API, /metrics), the programs it may start
and how (programs, launcher, runs), API keys and metering, and replicas.

May import: fastapi, uvicorn, sse_starlette, prometheus_client, the protocol
(symphony_protocol) and liblip. A client like any LIP: it starts programs with
`lip run --sandbox` (the OpenAI API is one, openai_lip) and never imports predd, kvfsd or
openai_lip internals.
"""
