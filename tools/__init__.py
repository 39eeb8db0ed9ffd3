"""The project's own development tools (not part of the edge)."""
