"""Tasks that ship with fedra: a digits classifier and a synthetic task for tests."""
