"""The pure core of a chat completion stream: events in, output events out.

Nothing in this package imports trio, quart, grpclib or asyncio, or does I/O.
"""
