"""`python -m edge.upstream`: iop-node's command, kept for the scripts that call it so.

The node itself is `edge.nodes.upstream` (`iop-node` is the same command).
"""
