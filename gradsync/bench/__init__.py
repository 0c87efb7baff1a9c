"""Benchmarks: ``gradsync bench ...`` commands, each beside a peer measured in the same run."""
