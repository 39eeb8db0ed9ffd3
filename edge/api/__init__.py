"""The APIs' wire formats, pure: no I/O.

Owns parsing and validating the bodies of chat completions, Responses and
Messages into one `ChatRequest`, rendering the session's output events as each
API's stream events and whole answers, each API's error shape, the
forwarding policy, and a request's prefix fingerprint (`fingerprint`).

May import `observe` (bounded log values), `stream`, `forwarding` (the forwarding
policy's rules, shared with `iop-node`), `prefixchain` (the fingerprint's chained
hashes, shared with `iop-node`) and `errors` only.
"""
