"""The simulated node: a real grpclib NodeService for tests, demos and benchmarks."""
