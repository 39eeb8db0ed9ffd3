"""`python -m edge.sim`: the simulated node's command, kept for the scripts that call it so.

The node itself is `edge.nodes.sim` (`iop-sim-node` is the same command).
"""
