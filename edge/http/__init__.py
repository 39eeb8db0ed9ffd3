"""The HTTP face of the edge: the serving loop, the quart-trio app and its handlers.

Owns connections (accept, limits, waiting set, write path, HTTP/2 bounds, drain),
the app's routes and the one path every API request takes (`chat`: parse, admit,
start the fleet's answer, render it; `sse`: a streamed answer's writer), the
configuration each request runs on (`live`: the snapshot a reload swaps), and the
translation of the edge's errors into HTTP answers.

May import `fleet`, `limits`, `node` (for types), `config`, `api`, `observe`,
`stream`, `errors`; never `process` or `nodes`.
"""
