"""The HTTP face of the edge: the quart-trio app and its handlers."""
