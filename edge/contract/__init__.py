"""The node contract, as both sides share it: the code generated from `protos/`
(`_proto`, by `make proto`; never edited by hand), the Run RPC's path and the
message size limit (`routes`), and the codec both sides build on: the one size
check of a received message, messages serialized ahead of time (`codec`).

Imports nothing of the edge: the edge's client (`node`) and the nodes (`nodes`)
both build on it.
"""
