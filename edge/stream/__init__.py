"""The pure core of a stream: node events in, output events out.

Owns the per-stream session (sentinels, reasoning, tool calls written as text
and their validation, strict output, logprobs, the one terminal) and the
bounds on what a request may ask (`bounds`).

Nothing in this package imports trio, quart, grpclib or asyncio, or does I/O;
it imports only `errors`.
"""
