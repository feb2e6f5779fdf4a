"""Tasks that ship with fedra: the digits classifier and a synthetic task for tests and benchmarks."""
