"""Hostile input for the edge: malformed HTTP/1.1 and HTTP/2 bytes, and abusive requests.

Shared by the seeded fuzz test in `make test` and the hostile mix of
`make hostile`: `wire` sends one case over a real socket, `h1` and `h2`
generate cases from a seed, `triggers` holds the known one-packet cases,
`cases` numbers them all for replay, `payloads` builds the abusive
(authenticated) chat requests and the normal ones beside them.
"""
