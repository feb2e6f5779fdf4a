"""Tasks that ship with fedra: digits, a byte-level GPT language model, a synthetic task."""
